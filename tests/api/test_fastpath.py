"""Specialised calls (cupyfuse/fastpath.py): after the same prepared entry is hit twice in
a row, a fused module's repeated call runs one generated function. Every change the
general fast path notices must make that function decline (the call then takes the
general path and gives torch's answer): attribute values, train/eval, a weight updated
in place or replaced, a submodule swapped, hooks, shapes, strides, another stream,
another thread, another precision, clear_cache. Each scenario compares against a float64
reference at 1e-4 after the change, and checks the function was in place before it."""
from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
import torch.nn as nn

from cupyfuse import runner
from cupyfuse import config
import cupyfuse
from cupyfuse import fastpath
from helpers import quiet
from helpers import examples

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")


class Scaled(nn.Module):
    """A Linear, a scale attribute, an activation submodule, a row reduction."""

    def __init__(self, fin: int = 64, fout: int = 48) -> None:
        super().__init__()
        self.fc = nn.Linear(fin, fout)
        self.act = nn.GELU()
        self.scale = 0.5
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.act(self.fc(x)) * self.scale)
        return torch.softmax(h, -1) + h.mean(-1, keepdim=True)


class Pair(nn.Module):
    """Two outputs (a tuple), a second input, a bool argument."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor, y: torch.Tensor, flip: bool = False) -> tuple:
        h = self.fc(x) + y
        if flip:
            h = -h
        return torch.tanh(h), h.amax(-1)


def _check(fused_out, ref):
    outs = fused_out if isinstance(fused_out, tuple) else (fused_out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o.double(), r, atol=1e-4, rtol=1e-4)


def _f64(orig: nn.Module, *args):
    m = copy.deepcopy(orig).double()
    return quiet(m, *[a.double() if isinstance(a, torch.Tensor) else a for a in args])


def _warm(fm, *args, calls: int = 4):
    for _ in range(calls):
        out = quiet(fm, *args)
    return out


def _runner(fm):
    """The runner of a from_model FusedModel or of a fused_class instance."""
    d = fm.__dict__
    return d["_runner"] if "_runner" in d else d["_cupyfuse_runner"]


@pytest.fixture
def scaled():
    torch.manual_seed(0)
    orig = Scaled().to(DEV).eval()
    fm = cupyfuse.from_model(orig)
    x = torch.randn(8, 64, device=DEV)
    _check(_warm(fm, x), _f64(orig, x))
    assert _runner(fm)._spec is not None, "no specialised call after repeated calls"
    return orig, fm, x


def test_specialised_call_is_built_and_used(scaled):
    orig, fm, x = scaled
    spec = _runner(fm)._spec
    calls = []

    def counting(outer, args):
        r = spec(outer, args)
        calls.append(r is not None)
        return r

    _runner(fm)._spec = counting
    for _ in range(3):
        _check(quiet(fm, x), _f64(orig, x))
    assert calls == [True, True, True]
    assert "LAUNCH(" in spec.source


def test_specialised_call_off():
    torch.manual_seed(1)
    orig = Scaled().to(DEV).eval()
    fm = cupyfuse.from_model(orig)
    x = torch.randn(8, 64, device=DEV)
    config.FASTPATH = False
    try:
        _check(_warm(fm, x), _f64(orig, x))
        assert _runner(fm)._spec is None
    finally:
        config.FASTPATH = True


@pytest.mark.parametrize("change", [
    "scale", "scale_negzero", "train", "weight_inplace", "weight_replaced", "act_swapped",
    "bias_removed", "forward_hook", "batch", "strided", "stream", "precision", "clear_cache",
    "global_hook"])
def test_specialised_call_declines_after_a_change(scaled, change):
    orig, fm, x = scaled
    args = (x,)
    handle = None
    if change == "scale":
        orig.scale = 2.0
    elif change == "scale_negzero":
        orig.scale = 0.0
        _check(_warm(fm, x), _f64(orig, x))
        orig.scale = -0.0
    elif change == "train":
        fm.train()   # active dropout is refused (random); the specialised call must not run
        with pytest.raises(cupyfuse.TailError, match="dropout"):
            quiet(fm, x)
        orig.drop.p = 0.0   # training mode without dropout: the train flag in the snapshot
    elif change == "weight_inplace":
        with torch.no_grad():
            orig.fc.weight.mul_(-1.5)
    elif change == "weight_replaced":
        orig.fc.weight = nn.Parameter(torch.randn(48, 64, device=DEV) * 0.1)
    elif change == "act_swapped":
        orig.act = nn.Tanh()
    elif change == "bias_removed":
        orig.fc.bias = None
    elif change == "forward_hook":
        seen = []
        handle = orig.fc.register_forward_hook(lambda m, a, o: seen.append(1))
    elif change == "batch":
        args = (torch.randn(5, 64, device=DEV),)
    elif change == "strided":
        args = (torch.randn(64, 8, device=DEV).t(),)
    elif change == "precision":
        fm.cupyfuse_precision = "high"
    elif change == "clear_cache":
        cupyfuse.clear_cache()
    elif change == "global_hook":
        handle = nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        if change == "forward_hook":
            with pytest.raises(cupyfuse.TailError):
                quiet(fm, *args)
            return
        if change == "global_hook":
            with pytest.raises(cupyfuse.TailError):
                quiet(fm, *args)
            return
        if change == "stream":
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                out = quiet(fm, *args)
            s.synchronize()
            _check(out, _f64(orig, *args))
            return
        tol = 5e-3 if change == "precision" else None
        for _ in range(3):   # the changed call, then its own specialised call
            out = quiet(fm, *args)
            if tol:
                torch.testing.assert_close(out.double(), _f64(orig, *args), atol=tol, rtol=tol)
            else:
                _check(out, _f64(orig, *args))
        if change not in ("precision",):
            # and back: the old entry's answer again
            assert _runner(fm)._spec is not None
    finally:
        if handle is not None:
            handle.remove()


def test_specialised_call_other_thread(scaled):
    orig, fm, x = scaled
    ref = _f64(orig, x)
    outs, errs = [], []

    def work():
        try:
            for _ in range(4):
                outs.append(quiet(fm, x))
        except Exception as e:   # noqa: BLE001 - reported below
            errs.append(e)

    th = threading.Thread(target=work)
    th.start()
    th.join()
    assert not errs
    torch.cuda.synchronize()
    for o in outs:
        _check(o, ref)
    _check(quiet(fm, x), ref)


def test_specialised_call_alternating_shapes_and_attribute_pingpong(scaled):
    orig, fm, x = scaled
    x5 = torch.randn(5, 64, device=DEV)
    for i in range(6):
        a = x if i % 2 else x5
        orig.scale = 0.5 if i % 3 else 1.25
        _check(quiet(fm, a), _f64(orig, a))


def test_specialised_call_several_inputs_and_results():
    torch.manual_seed(2)
    orig = Pair().to(DEV)
    fm = cupyfuse.from_model(orig)
    x, y = torch.randn(8, 64, device=DEV), torch.randn(8, 32, device=DEV)
    for flip in (False, True, False):
        _check(_warm(fm, x, y, flip), _f64(orig, x, y, flip))
    runner = _runner(fm)
    assert runner._spec is not None
    y2 = torch.randn(8, 32, device=DEV)   # another second input: its address per call
    _check(quiet(fm, x, y2, False), _f64(orig, x, y2, False))
    _check(quiet(fm, x, y2, True), _f64(orig, x, y2, True))
    with pytest.raises(Exception):
        quiet(fm, x, y.double(), False)


def test_specialised_call_fused_class_engine_batch():
    """fused_class at an engine batch (3xTF32 weights: their versions are checked)."""
    torch.manual_seed(3)
    cls = cupyfuse.fused_class(Scaled)
    m = cls(512, 512).to(DEV).eval()
    orig = Scaled(512, 512).to(DEV).eval()
    orig.load_state_dict(m.state_dict())
    x = torch.randn(256, 512, device=DEV)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _check(_warm(m, x), _f64(orig, x))
        with torch.no_grad():
            m.fc.weight.add_(0.01)
            orig.fc.weight.add_(0.01)
        _check(quiet(m, x), _f64(orig, x))
        _check(_warm(m, x), _f64(orig, x))


def test_prepared_function_call_in_a_fresh_thread():
    """fused_linear's prepared launch from a thread that never used CUDA before (the
    thread's first launch binds the device's context: without it, the launch fails with
    CUDA_ERROR_INVALID_CONTEXT)."""
    torch.manual_seed(4)
    x = torch.randn(16, 64, device=DEV)
    w, b = torch.randn(32, 64, device=DEV) * 0.1, torch.randn(32, device=DEV)

    def tail(h):
        return torch.sigmoid(h).sum(dim=1, keepdim=True)

    ref = tail(x.double() @ w.double().t() + b.double())
    for _ in range(3):
        _check(cupyfuse.fused_linear(x, w, b, tail), ref)
    outs, errs = [], []

    def work():
        try:
            for _ in range(3):
                outs.append(cupyfuse.fused_linear(x, w, b, tail))
            torch.cuda.synchronize()
        except Exception as e:   # noqa: BLE001 - reported below
            errs.append(e)

    th = threading.Thread(target=work)
    th.start()
    th.join()
    assert not errs, errs
    assert len(outs) == 3
    for o in outs:
        _check(o, ref)


SCALE = 2.0   # a global the tail below reads (its value is part of the prepared key)


def _gtail(h):
    return torch.sigmoid(h * SCALE).sum(dim=1, keepdim=True)


def _fn_ref(x, w, b):
    h = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    return torch.sigmoid(h * SCALE).sum(dim=1, keepdim=True)


@pytest.mark.parametrize("rows", [8, 256])   # the skinny kernel; the 3xTF32 engine
def test_function_specialised_call(rows):
    global SCALE

    torch.manual_seed(5)
    x = torch.randn(rows, 512, device=DEV)
    w = nn.Parameter(torch.randn(384, 512, device=DEV) * 0.05)
    b = torch.randn(384, device=DEV)
    for _ in range(4):
        _check(cupyfuse.fused_linear(x, w, b, _gtail), _fn_ref(x, w, b))
    spec = runner._fn_specs.get(_gtail)
    assert spec is not None, "no specialised call after repeated calls"
    calls = []

    def counting(*a):
        r = spec(*a)
        calls.append(r is not None)
        return r

    runner._fn_specs[_gtail] = counting
    _check(cupyfuse.fused_linear(x, w, b, _gtail), _fn_ref(x, w, b))
    assert calls == [True]
    # every change below must give the right answer (the specialised call declines)
    w2 = nn.Parameter(torch.randn(384, 512, device=DEV) * 0.05)   # another weight
    _check(cupyfuse.fused_linear(x, w2, b, _gtail), _fn_ref(x, w2, b))
    with torch.no_grad():
        w.mul_(-1.0)   # the same weight, changed in place
    for _ in range(3):
        _check(cupyfuse.fused_linear(x, w, b, _gtail), _fn_ref(x, w, b))
    _check(cupyfuse.fused_linear(x, w, None, _gtail), _fn_ref(x, w, None))
    x2 = torch.randn(rows + 3, 512, device=DEV)
    _check(cupyfuse.fused_linear(x2, w, b, _gtail), _fn_ref(x2, w, b))
    xs = torch.randn(512, rows, device=DEV).t()   # strided x
    _check(cupyfuse.fused_linear(xs, w, b, _gtail), _fn_ref(xs, w, b))
    SCALE = -1.0
    try:
        for _ in range(3):
            _check(cupyfuse.fused_linear(x, w, b, _gtail), _fn_ref(x, w, b))
    finally:
        SCALE = 2.0
    _check(cupyfuse.fused_linear(x, w, b, _gtail), _fn_ref(x, w, b))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out = cupyfuse.fused_linear(x, w, b, _gtail)
    s.synchronize()
    _check(out, _fn_ref(x, w, b))
    cupyfuse.clear_cache()
    assert runner._fn_specs.get(_gtail) is None
    for _ in range(3):
        _check(cupyfuse.fused_linear(x, w, b, _gtail), _fn_ref(x, w, b))
    import cupy

    xc, wc, bc = cupy.asarray(x), cupy.asarray(w.detach()), cupy.asarray(b)
    got = cupyfuse.fused_linear(xc, wc, bc, _gtail)
    _check(torch.as_tensor(got, device=DEV), _fn_ref(x, w, b))


def _spec_used(fm, x, orig):
    """One call: the float64 answer, and whether the specialised call gave it."""
    runner = _runner(fm)
    spec = runner._spec
    assert spec is not None
    used = []

    def counting(outer, args):
        r = spec(outer, args)
        used.append(r is not None)
        return r

    runner._spec = counting
    try:
        _check(quiet(fm, x), _f64(orig, x))
    finally:
        if runner._spec is counting:
            runner._spec = spec
    return bool(used and used[0])


@pytest.mark.parametrize("kind", ["from_model", "fused_class"])
def test_specialised_call_honours_the_modules_call(kind):
    """The specialised call runs before torch's Module.__call__ is entered: anything that
    call would do besides calling the fused forward must make it decline -- the outer
    module's hooks of each kind, global hooks, a forward set on the instance, a subclass
    with its own forward -- and it runs again once that is gone."""
    torch.manual_seed(6)
    if kind == "from_model":
        # (a view shares the model's hooks: the reference is a copy of its own)
        orig = Scaled().to(DEV).eval()
        fm = cupyfuse.from_model(copy.deepcopy(orig))
    else:
        fm = cupyfuse.fused_class(Scaled)().to(DEV).eval()
        orig = Scaled().to(DEV).eval()
        orig.load_state_dict(fm.state_dict())
    x = torch.randn(8, 64, device=DEV)
    _warm(fm, x)
    assert _spec_used(fm, x, orig)
    seen = []
    glob = nn.modules.module
    # the module's own hooks: torch's call runs them, the fused forward gives the answer
    for register in (lambda: fm.register_forward_hook(lambda m, a, o: seen.append("f")),
                     lambda: fm.register_forward_pre_hook(lambda m, a: seen.append("p")),
                     lambda: fm.register_full_backward_hook(lambda m, gi, go: None),
                     lambda: glob.register_module_full_backward_hook(lambda m, gi, go: None)):
        h = register()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert not _spec_used(fm, x, orig)
        finally:
            h.remove()
        assert _spec_used(fm, x, orig)   # gone: used again
    assert seen == ["f", "p"]
    # global forward hooks would run on the submodules too: refused, never run silently
    for register in (lambda: glob.register_module_forward_hook(lambda m, a, o: None),
                     lambda: glob.register_module_forward_pre_hook(lambda m, a: None)):
        h = register()
        try:
            with pytest.raises(cupyfuse.TailError):
                quiet(fm, x)
        finally:
            h.remove()
        assert _spec_used(fm, x, orig)
    # a forward set on the instance: called instead
    fm.forward = lambda *a: torch.zeros(1, device=DEV)
    try:
        assert quiet(fm, x).shape == (1,)
    finally:
        del fm.forward
    assert _spec_used(fm, x, orig)


# ---------------------------------------------------------------------------------
# property: any sequence of state changes and calls gives torch's answer at every call
from hypothesis import HealthCheck, given, settings   # noqa: E402
from hypothesis import strategies as hst   # noqa: E402

ACTIONS = ["call", "call", "call", "call_other_batch", "scale", "train_eval", "weight_inplace",
           "weight_replaced", "act_swapped", "bias_toggled", "precision", "strided_call",
           "hook_on_outer"]


@settings(max_examples=examples(25), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(kind=hst.sampled_from(["from_model", "fused_class"]),
       steps=hst.lists(hst.tuples(hst.sampled_from(ACTIONS), hst.integers(0, 3)),
                       min_size=4, max_size=14))
def test_any_sequence_of_changes_and_calls(kind, steps):
    """A random sequence of calls and of the changes the specialised call must see
    (attribute values with signed zeros, the train flag, the weight in place or replaced,
    a submodule swapped, the bias removed and back, the precision, strided and other-batch
    inputs, a hook on the module): after every call the result is the float64 answer of
    the model as it is then (engine batches: 3xTF32 tolerance)."""
    torch.manual_seed(7)
    if kind == "from_model":
        orig = Scaled().to(DEV).eval()
        orig.drop.p = 0.0
        fm = cupyfuse.from_model(orig)
        target = orig
    else:
        fm = cupyfuse.fused_class(Scaled)().to(DEV).eval()
        fm.drop.p = 0.0
        target = fm
    xs = {8: torch.randn(8, 64, device=DEV), 300: torch.randn(300, 64, device=DEV),
          5: torch.randn(5, 64, device=DEV)}
    seen = []
    handle = None
    try:
        for act, v in steps:
            x = xs[8]
            if act == "call_other_batch":
                x = xs[300 if v % 2 else 5]
            elif act == "strided_call":   # a transposed x, or every other feature
                x = torch.randn(64, 8, device=DEV).t() if v % 2 else \
                    torch.randn(8, 128, device=DEV)[:, ::2]
            elif act == "scale":
                target.scale = (0.5, 0.0, -0.0, 2.0)[v]
            elif act == "train_eval":
                fm.train(v % 2 == 0)
            elif act == "weight_inplace":
                with torch.no_grad():
                    target.fc.weight.mul_(-1.0 if v % 2 else 1.5)
            elif act == "weight_replaced":
                target.fc.weight = nn.Parameter(torch.randn(48, 64, device=DEV) * 0.1)
            elif act == "act_swapped":
                target.act = (nn.GELU(), nn.Tanh(), nn.SiLU(), nn.GELU())[v]
            elif act == "bias_toggled":
                target.fc.bias = None if target.fc.bias is not None else \
                    nn.Parameter(torch.randn(48, device=DEV))
            elif act == "precision":
                fm.cupyfuse_precision = (None, "highest", None, "highest")[v]
            elif act == "hook_on_outer":
                if handle is None:
                    handle = fm.register_forward_hook(lambda m, a, o: seen.append(1))
                else:
                    handle.remove()
                    handle = None
            out = quiet(fm, x)
            ref = copy.deepcopy(target)
            if kind == "fused_class":
                ref.__class__ = Scaled   # the original forward, on the same state
            ref = quiet(ref.double(), x.double())
            torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    finally:
        if handle is not None:
            handle.remove()
