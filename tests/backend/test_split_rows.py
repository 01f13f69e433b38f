"""Wide rows at small batches split over a thread-block cluster (codegen.Level.launch: a
level kernel's `_cl` entry runs each row over SPLIT_PARTS blocks, its row reductions
combined across the blocks in rank order, tail_ops.cuh's cf_row_combine). CPU: which
levels split and how they launch; GPU (sm90): the split launches against float64, NaN and
inf rows, run-to-run bits, and that the prepared call took the `_cl` entry."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cupyfuse import config
import cupyfuse
from cupyfuse.backend import codegen, runtime
from cupyfuse.interop import cupy_available
from helpers import program_of, runner_of


class Tail(nn.Module):
    def __init__(self, k: int, width: int, tail):
        super().__init__()
        self.linear = nn.Linear(k, width)
        self.tail = tail

    def forward(self, x):
        return self.tail(self.linear(x))


def softmax_gelu(h):
    return torch.softmax(F.gelu(h), dim=1)


def sigmoid_sum(h):
    return torch.sigmoid(h).sum(dim=1, keepdim=True)


def lse_max(h):
    return torch.logsumexp(h, dim=1, keepdim=True) - h.max(dim=1, keepdim=True)[0]


def layer_norm(h):
    m = h.mean(dim=1, keepdim=True)
    v = ((h - m) ** 2).mean(dim=1, keepdim=True)
    return (h - m) / torch.sqrt(v + 1e-5)


def argmax(h):
    return torch.argmax(torch.tanh(h), dim=1)


def group_norm(h):   # group sums: a phase of its own (shared memory): never split
    return F.group_norm(h.unsqueeze(-1), 8).squeeze(-1)


TAILS = [softmax_gelu, sigmoid_sum, lse_max, layer_norm, argmax]


def _levels(tail, width, k=64):
    f = cupyfuse.from_model(Tail(k, width, tail))
    prog = program_of(f, torch.rand(2, k))
    return [lv for lv in codegen.compile_program(prog).levels if lv.kernel]


@pytest.mark.parametrize("tail", TAILS)
def test_wide_row_reduction_levels_get_a_cluster_entry(tail):
    (lv,) = _levels(tail, 8192)
    assert lv.split == config.SPLIT_PARTS > 1
    fmts = runtime.kernel_formats(lv.kernel)
    assert fmts[lv.name + "_cl"] == fmts[lv.name]   # the same parameters, launched alike
    name, text = codegen.ksum_source(lv, 4, 1 << 20)   # the split-K reading form has one too
    assert runtime.kernel_formats(text)[name + "_cl"] == fmts[lv.name]
    assert f"CF_ROW_CLUSTER({lv.split})" in lv.kernel
    # two row functions: one block per row (the plain loops and block combines), and the
    # `_cl` entry's (cluster combines, loops of the cluster's fixed stride)
    plain = lv.kernel.split("_row(")[1].split("_rowc(")[0]
    clus = lv.kernel.split("_rowc(")[1].split('extern "C"')[0]
    assert "cf_row_combine<" not in plain and "CF_F0" not in plain and "cf_block_combine<" in plain
    assert "cf_row_combine<" in clus and "cf_block_combine<" not in clus and "CF_FS" not in clus
    assert f"CF_F0 + s_ * {lv.split * lv.split_threads};" in clus
    cl = lv.kernel.split("_cl(")[1]
    assert f"{lv.name}_rowc(row, " in cl and "cf_row_end();" in cl
    for rows in (1, 7, config.SPLIT_MAX_ROWS):
        assert lv.launch(rows) == (lv.name + "_cl", rows * lv.split)
    for rows in (config.SPLIT_MAX_ROWS + 1, 4096):
        assert lv.launch(rows) == (lv.name, rows)


def _emulated_call(prog, tens, srcs, mp):
    """Prepared launches on the CPU (tests/emu/prepared.py): (the launch log, the emulated
    general path's result, the prepared call's result)."""
    from emu import gpu as _gpuemu
    from emu import prepared as _prepemu

    log = _prepemu.install(mp)
    run = _prepemu.runnable(prog)
    general = _gpuemu.run_program_emulated(run, tens, srcs, mp)
    pr = _prepemu.prepare(run, tens, srcs)
    assert pr is not None
    return log, general, _prepemu.call(pr, tens, srcs)


@pytest.mark.parametrize("tail,width", [(softmax_gelu, config.SPLIT_MIN_WIDTH - 1),
                                        (sigmoid_sum, 512), (group_norm, 8192)])
def test_narrow_rows_and_other_phases_are_not_split(tail, width):
    for lv in _levels(tail, width):
        assert lv.split == 0 and "_cl(" not in lv.kernel
        assert lv.launch(1) == (lv.name, 1)
        # the kernel of one block per row, no split
        assert "CF_F0" not in lv.kernel.split("_row(")[1] and "cf_row_combine<" not in lv.kernel.split("_row(")[1]


def two_phase_input(h):   # the last phase reads h itself again, and a value kept
    return h * torch.softmax(h * 0.5, dim=1) + torch.tanh(h).mean(dim=1, keepdim=True)


def sliced(h):   # a value read at other features (a slice): nothing kept in registers
    w = h.shape[1] // 2
    return torch.softmax(h[:, :w], dim=1) * h[:, w:2 * w].sum(dim=1, keepdim=True)


EMU_TAILS = TAILS + [two_phase_input, sliced]


@pytest.mark.parametrize("tail", EMU_TAILS)
def test_cluster_row_function_keeps_what_later_phases_read(tail):
    """The `_cl` row function keeps in registers the values a later phase reads (filled by
    the first loop computing them), and nothing where a value is read at other features."""
    (lv,) = _levels(tail, 8192)
    clus = lv.kernel.split("_rowc(")[1].split('extern "C"')[0]
    kept = [ln for ln in clus.splitlines() if ln.strip().startswith("float c")]
    if tail in (sigmoid_sum, sliced, argmax):   # one phase / a slice / keys of one loop
        assert not kept, kept
    else:
        assert kept and all(f"[{-(-8192 // (lv.split * lv.split_threads))}];" in k for k in kept)
        for k in kept:   # each filled once, in a loop, and read through its lambda
            i = k.split("float c")[1].split("[")[0]
            assert clus.count(f"c{i}[cj] = v{i}_c(f);") == 1
            assert f"auto v{i} = [&](int f) -> float {{ (void)f; return c{i}[cj]; }};" in clus


def test_cluster_row_function_emulated(tmp_path_factory, monkeypatch):
    """The `_cl` entry's row function compiled as C++ (tests/emu/cuda.py: a cluster of 2
    blocks of 256 threads run as one block of 512, its combines the block's): rows of 1100
    features (three steps of 512, the last one partly past the row) and of 1024, NaN and inf
    rows, against float64; and the same bits with nothing kept in registers
    (config.CACHE_FLOATS = 0) and with one value kept (3: the budget cuts the rest):
    keeping values changes no arithmetic."""
    from emu import cuda as _cuda_emu
    from emu import gpu as _gpuemu

    if _cuda_emu.CXX is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setattr(config, "SPLIT_PARTS", 2)
    monkeypatch.setattr(config, "SPLIT_THREADS", 256)
    monkeypatch.setattr(config, "SPLIT_MIN_WIDTH", 1000)
    cases = []
    for j, tail in enumerate(EMU_TAILS):
        for width in (1100, 1024):
            torch.manual_seed(j * 7 + width)
            model = Tail(16, width, tail).eval()
            x = torch.randn(4, 16) * (1.0 + j)
            x[1, 3] = float("nan")
            x[2, 5] = float("inf")
            prog, tens, srcs = _gpuemu.model_program(model, [x])
            cases.append((tail.__name__, width, model, x, prog, tens, srcs))
    outs = {}
    for cache in (config.CACHE_FLOATS, 3, 0):   # (3: one value kept, past the budget)
        with monkeypatch.context() as mp:
            mp.setattr(config, "CACHE_FLOATS", cache)
            kernels = _cuda_emu.build_or_skip([c[4] for c in cases],
                                              tmp_path_factory.mktemp(f"emu{cache}"))
            kept = 0
            for name, width, _, _, prog, tens, srcs in cases:
                lvs = codegen.plan(_cuda_emu._runnable(prog)).levels
                assert any(lv.split for lv in lvs), name
                kept += any("float c" in lv.kernel.split("_rowc(")[1] for lv in lvs if lv.split)
                outs[(name, width, cache)] = _cuda_emu.run_program(prog, tens, srcs, kernels,
                                                                   cluster=True)
            assert (kept > 0) == (cache > 0), kept
    for name, width, model, x, _, _, _ in cases:
        got, plain = outs[(name, width, config.CACHE_FLOATS)], outs[(name, width, 0)]
        for some in (got, outs[(name, width, 3)]):
            assert torch.equal(some.isnan(), plain.isnan()), name
            assert torch.equal(torch.nan_to_num(some.double()),
                               torch.nan_to_num(plain.double())), \
                f"{name} {width}: keeping values in registers changed bits"
        if name == "argmax":
            continue   # (positions: the GPU test checks them)
        with torch.no_grad():
            want = copy.deepcopy(model).double()(x.double())
        assert torch.equal(torch.isnan(got), torch.isnan(want)), (name, width)
        fin = torch.isfinite(want)
        torch.testing.assert_close(got.double()[fin], want[fin], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("batch", [3, 12])
def test_tail_reads_the_skinny_gemms_partial_sums_emulated(batch, monkeypatch):
    """Prepared launches on the CPU: a skinny GEMM split along K whose only reader is the
    next tail kernel leaves its partial sums (no counters, so its last blocks add nothing)
    and the tail adds them as it loads (codegen.ksum_source's name, the partials' buffer
    in its GEMM slot), launched as a dependent; the results match the general path
    bit for bit and float64. With config.SKINNY_KSUM off the GEMM adds them itself."""
    from emu import gpu as _gpuemu
    from emu import prepared as _prepemu

    from cupyfuse.backend import engine, prepared

    torch.manual_seed(batch)
    model = Tail(2048, config.SPLIT_MIN_WIDTH + 5, softmax_gelu).eval()
    x = torch.randn(batch, 2048)
    x[1, 2] = float("nan")
    splits = engine.skinny_plan(batch, config.SPLIT_MIN_WIDTH + 5, 2048, _prepemu.SM).splits
    assert splits > 1
    prog, tens, srcs = _gpuemu.model_program(model, [x])
    outs = []
    for on in (True, False):
        with monkeypatch.context() as mp:
            mp.setattr(config, "SKINNY_KSUM", on)
            log, general, out = _emulated_call(prog, tens, srcs, mp)
        (gemm,) = [ln for ln in log if ln.name.startswith("gemm_skinny")]
        (tail,) = [ln for ln in log if ln.name.startswith("cf_tail")]
        part, counters = gemm.vals[10], gemm.vals[11]
        assert part != 0 and (counters == 0) == on, (part, counters)
        assert (f"_ks{splits}_" in tail.name) == on and tail.name.endswith("_cl") and tail.dep
        if on:   # the tail's GEMM value: the partials' buffer
            assert part in tail.vals, (part, tail.vals)
        assert _prepemu.same_bits(out, general)
        outs.append(out)
    assert _prepemu.same_bits(outs[0], outs[1])
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
    ok = ~torch.isnan(want)
    assert torch.equal(torch.isnan(outs[0]), ~ok)
    torch.testing.assert_close(outs[0].double()[ok], want[ok], atol=1e-4, rtol=1e-4)


class Plain(nn.Module):   # the GEMM's value is the result: no tail reads it
    def __init__(self, k: int, width: int):
        super().__init__()
        self.linear = nn.Linear(k, width, bias=False)   # (a bias would be a tail)

    def forward(self, x):
        return self.linear(x)


@pytest.mark.parametrize("cls", ["tail", "plain"])
def test_skinny_partials_buffer_only_where_a_tail_reads_it(cls, monkeypatch):
    """The partial sums' buffer of a skinny GEMM split along K is part of the kept
    workspace only where a tail adds the splits (the tail form); a GEMM whose value is
    the result adds them itself and has no such buffer."""
    from emu import gpu as _gpuemu
    from emu import prepared as _prepemu

    from cupyfuse.backend import engine

    torch.manual_seed(1)
    width = config.SPLIT_MIN_WIDTH + 5
    model = (Tail(2048, width, softmax_gelu) if cls == "tail" else Plain(2048, width)).eval()
    splits = engine.skinny_plan(12, width, 2048, _prepemu.SM).splits
    assert splits > 1
    _prepemu.install(monkeypatch)
    prog, tens, srcs = _gpuemu.model_program(model, [torch.randn(12, 2048)])
    pr = _prepemu.prepare(prog, tens, srcs)
    parts = [b for b in pr.bufs if tuple(b) == (splits, 12, width)]
    assert len(parts) == (1 if cls == "tail" else 0), pr.bufs
    (gemm,) = [st for st in pr.steps if st.skinny is not None]
    # (no counters where the tail adds the splits: the skinny step's parts 0)
    assert (gemm.skinny[2] == 0) == (cls == "tail")


class TailAndValue(nn.Module):   # the GEMM's value is a result too
    def __init__(self, k: int, width: int):
        super().__init__()
        self.linear = nn.Linear(k, width)

    def forward(self, x):
        h = self.linear(x)
        return softmax_gelu(h), h


def test_skinny_gemm_value_returned_through_the_tail_emulated(monkeypatch):
    """The GEMM's value returned as a result too: the result is a node of its own
    (Program.own_results) that the tail kernel writes, so the tail is still the value's
    only reader -- it adds the K splits (the skinny GEMM without counters) and writes both
    results; each matches float64."""
    from emu import gpu as _gpuemu
    from emu import prepared as _prepemu

    torch.manual_seed(0)
    model = TailAndValue(2048, config.SPLIT_MIN_WIDTH + 5).eval()
    x = torch.randn(12, 2048)
    prog, tens, srcs = _gpuemu.model_program(model, [x])
    log = _prepemu.install(monkeypatch)
    pr = _prepemu.prepare(_prepemu.runnable(prog), tens, srcs)
    assert pr is not None
    outs = _prepemu.call(pr, tens, srcs)
    (gemm,) = [ln for ln in log if ln.name.startswith("gemm_skinny")]
    (tail,) = [ln for ln in log if ln.name.startswith("cf_tail")]
    assert gemm.vals[10] != 0 and gemm.vals[11] == 0 and "_ks" in tail.name
    assert len(outs) == 2
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
    for got, w in zip(outs, want):
        torch.testing.assert_close(got.double(), w, atol=1e-4, rtol=1e-4)


# --- GPU ------------------------------------------------------------------------------
hopper = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_matmul"),
          pytest.mark.skipif(not (torch.cuda.is_available() and cupy_available()
                                  and torch.cuda.get_device_capability() == (9, 0)),
                             reason="prepared launches and clusters need an sm90 GPU")]


def _ref64(model, x):
    lin = model.linear
    h = x.double() @ lin.weight.double().T + lin.bias.double()
    return model.tail(h)


def _entries(f):
    return [st.fn.name for v in runner_of(f).fast.values() if v is not None for st in v[0].steps]


@hopper[0]
@hopper[1]
@hopper[2]
@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("width", [4096, 5003, 16384])
@pytest.mark.parametrize("batch", [1, 5, 32, 33])
def test_split_rows_match_float64(tail, width, batch):
    g = torch.Generator(device="cuda").manual_seed(width + batch)
    torch.manual_seed(width + batch)
    model = Tail(96, width, tail).cuda()
    f = cupyfuse.from_model(model)
    x = torch.randn(batch, 96, device="cuda", generator=g)
    if batch > 2:
        x[1, 3] = float("nan")    # a NaN row
        x[2, 5] = float("inf")    # an infinite row
    with torch.no_grad():
        first = f(x)
        f(x)                       # prepared from the second call (or the first)
        again = f(x)
    names = _entries(f)
    split = any(n.endswith("_cl") for n in names)
    assert split == (batch <= config.SPLIT_MAX_ROWS), names
    assert torch.equal(again.isnan(), first.isnan())
    assert torch.equal(torch.nan_to_num(again), torch.nan_to_num(first)), "not bitwise run to run"
    want = _ref64(model, x)
    if tail is argmax:
        ok = ~torch.isnan(x).any(1) & ~torch.isinf(x).any(1)
        got = again[ok]
        h = (x.double() @ model.linear.weight.double().T + model.linear.bias.double())[ok]
        # the position found holds the largest value (ties within fp32 rounding allowed)
        best = torch.tanh(h).gather(1, got.view(-1, 1)).squeeze(1)
        assert (best >= torch.tanh(h).max(1)[0] - 1e-6).all()
        return
    assert torch.equal(torch.isnan(again), torch.isnan(want.float())), "NaN pattern"
    fin = torch.isfinite(want)
    torch.testing.assert_close(again.double()[fin], want[fin], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tail", [softmax_gelu, layer_norm])
@pytest.mark.parametrize("batch", [3, config.SPLIT_MAX_ROWS + 1])
def test_prepared_launches_take_the_cluster_entry_emulated(tail, batch, monkeypatch):
    """Prepared launches on the CPU (tests/emu/prepared.py): a wide tail at a small batch is a
    launch of the `_cl` entry, rows x SPLIT_PARTS blocks of SPLIT_THREADS threads with the
    plain entry's arguments; past SPLIT_MAX_ROWS rows the plain entry, a block per row.
    The results match the emulated general path and float64."""
    from emu import gpu as _gpuemu
    from emu import prepared as _prepemu

    torch.manual_seed(0)
    model = Tail(8, config.SPLIT_MIN_WIDTH + 5, tail).eval()
    x = torch.randn(batch, 8)
    x[1, 2] = float("nan")
    prog, tens, srcs = _gpuemu.model_program(model, [x])
    log, general, out = _emulated_call(prog, tens, srcs, monkeypatch)
    tails = [ln for ln in log if ln.name.startswith("cf_tail")]
    assert tails, [ln.name for ln in log]
    for ln in tails:
        # after the skinny GEMM a programmatic dependent launch (config.PDL_TAIL), else plain
        before = log[log.index(ln) - 1]
        assert ln.dep == before.name.startswith("gemm_skinny"), (before, ln, ln.dep)
        if batch <= config.SPLIT_MAX_ROWS:
            assert ln.name.endswith("_cl") and ln.grid == (batch * config.SPLIT_PARTS, 1, 1)
            assert ln.block == min(config.SPLIT_THREADS, codegen._threads(config.SPLIT_MIN_WIDTH + 5))
        else:
            assert not ln.name.endswith("_cl") and ln.grid == (batch, 1, 1)
    assert _prepemu.same_bits(out, general)
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
    ok = ~torch.isnan(want)
    assert torch.equal(torch.isnan(out), ~ok)
    torch.testing.assert_close(out.double()[ok], want[ok], atol=1e-4, rtol=1e-4)


def softmaxes(h):   # seven values kept at 32768 features: past the register budget
    a = torch.softmax(F.gelu(h), dim=1)
    c = (h - h.mean(dim=1, keepdim=True)) / (h.std(dim=1, keepdim=True) + 1e-5)
    return a * torch.sigmoid(c) + torch.logsumexp(c * a, dim=1, keepdim=True)


@hopper[0]
@hopper[1]
@hopper[2]
@pytest.mark.parametrize("batch", [3, 32])
def test_split_rows_past_the_register_budget_match_float64(batch):
    """A tail whose `_cl` row function would keep more values than config.CACHE_FLOATS
    (32768 features: 8 steps per thread) keeps the first ones and recomputes the rest."""
    (lv,) = _levels(softmaxes, 32768)
    clus = lv.kernel.split("_rowc(")[1].split('extern "C"')[0]
    kept = [ln for ln in clus.splitlines() if ln.strip().startswith("float c")]
    assert len(kept) == config.CACHE_FLOATS // 8, kept
    torch.manual_seed(batch)
    model = Tail(64, 32768, softmaxes).cuda()
    f = cupyfuse.from_model(model)
    x = torch.randn(batch, 64, device="cuda")
    x[1, 2] = float("nan")
    with torch.no_grad():
        f(x)
        got = f(x)
    assert any(n.endswith("_cl") for n in _entries(f))
    want = _ref64(model, x)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got.double()[fin], want[fin], atol=1e-4, rtol=1e-4)


@hopper[0]
@hopper[1]
@hopper[2]
@pytest.mark.parametrize("batch,width", [(5, 8192), (16, 16384)])
def test_dependent_tail_waits_for_the_skinny_gemm(batch, width):
    """A tail after the skinny GEMM is a programmatic dependent launch (config.PDL_TAIL):
    it may launch while the GEMM's last blocks run and waits for the GEMM before it reads
    its output. Eight calls queued back to back on new inputs (no synchronisation between
    them; the GEMM's output buffer is the same each call), then the call captured in a CUDA
    graph and replayed on new contents: each result matches float64, so no tail read a
    GEMM's output early (or a previous call's). With the wait cut out of the level
    kernels and the GEMM's trigger moved to its start, this test fails (with the trigger
    at the tile's end, where it is, launch latency alone covers the GEMM's last stores,
    and the wait's absence goes unseen)."""
    torch.manual_seed(batch)
    model = Tail(512, width, softmax_gelu).cuda()
    f = cupyfuse.from_model(model)
    xs = [torch.randn(batch, 512, device="cuda") * (1 + i) for i in range(8)]
    with torch.no_grad():
        f(xs[0])
        f(xs[0])
    steps = [st for v in runner_of(f).fast.values() if v is not None for st in v[0].steps]
    assert [(st.skinny is not None, st.dep) for st in steps] == [(True, False), (False, True)], \
        [(st.fn.name, st.dep) for st in steps]
    assert steps[1].fn.name.endswith("_cl")
    with torch.no_grad():
        outs = [f(x) for x in xs]   # queued
    for x, got in zip(xs, outs):
        want = _ref64(model, x)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    x = xs[0].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        f(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        static = f(x)
    for i in (1, 2, 3):
        x.copy_(xs[i])
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static.double(), _ref64(model, xs[i]), atol=1e-4, rtol=1e-4)
