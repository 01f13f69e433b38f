"""The outside-written corpus (tests/corpus/outside/) on the CPU.

Every model, in each of its modes, through ``cupyfuse.from_model`` (two seeds) and
``cupyfuse.fused_class`` on its class (one seed), must do what the corpus records: convert
and equal the float64 eager model at atol = rtol = 1e-4 (outputs with NaN/inf where torch
has them, BatchNorm buffers in train mode, a second batch size after an optimizer-like
in-place update of every parameter and buffer), or be refused with a ``TailError`` whose
message names an op and a source line. A wrong answer or any other exception fails; so
does an unexpected conversion (update the expectation to ``CONVERTS``). Known problems are
strict xfails (``Case.xfail``), which let a wrong answer through as a failure
(``pytest.fail`` is not the AssertionError the mark expects).
"""
from __future__ import annotations

import warnings

import pytest
import torch

import cupyfuse
from cupyfuse import TailError
from corpus.outside import CONVERTS, REFUSED, all_cases
from corpus.outside import harness
from corpus.outside.harness import Outcome, refusal_problem, run_case, run_nonfinite

CASES = all_cases()
OF_THE_KIND = [c for c in CASES if c.module != "out_of_scope"]


def _params(apis=("from_model", "fused_class")):
    out = []
    for c in CASES:
        for mode in c.modes:
            for api in apis:
                reason = c.xfail_reason(mode)
                marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)] \
                    if reason else []
                out.append(pytest.param(c, mode, api, id=f"{c.name}-{mode}-{api}", marks=marks))
    return out


def check_outcome(c, mode: str, o: Outcome) -> None:
    """Fail on a wrong answer or another exception (pytest.fail: never taken by an xfail
    mark); assert the recorded expectation (AssertionError: a known problem's xfail)."""
    if o.status == "mismatch":
        pytest.fail(f"WRONG ANSWER: {c.name} ({mode}) converts and differs from the float64 "
                    f"eager model:\n{o.message}", pytrace=False)
    if c.xfail_reason(mode):
        assert o.status in ("match", "refused"), f"{c.name} ({mode}): {o.message}"
        if o.status == "refused":
            assert refusal_problem(o.message) is None, refusal_problem(o.message)
        return
    if o.status == "error":
        pytest.fail(f"{c.name} ({mode}): an exception other than TailError:\n{o.message}",
                    pytrace=False)
    exp = c.expected(mode)
    assert exp in (CONVERTS, REFUSED), f"{c.name} ({mode}): no expectation recorded"
    if exp == CONVERTS:
        assert o.status == "match", f"{c.name} ({mode}) expected to convert, refused:\n{o.message}"
    else:
        assert o.status == "refused", (
            f"{c.name} ({mode}) expected to be refused, but it converts and matches the float64 "
            f"model (max scaled error {o.err:.3g}): update its expectation to CONVERTS")
        problem = refusal_problem(o.message)
        assert problem is None, f"{c.name} ({mode}): {problem}:\n{o.message}"


@pytest.mark.parametrize("c, mode, api", _params())
def test_outside_model(c, mode, api):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = run_case(c, mode, api, seeds=(0, 1) if api == "from_model" else (0,))
    check_outcome(c, mode, o)


@pytest.mark.parametrize("c", [c for c in OF_THE_KIND if c.nonfinite and
                               "cpu" in c.nonfinite_devices], ids=lambda c: c.name)
def test_outside_nonfinite_inputs(c):
    """NaN, +inf and -inf in the first input: the fused model's NaN/inf where PyTorch's
    float32 model has them, finite elements as the float64 model."""
    mode = "eval" if "eval" in c.modes else c.modes[0]
    if c.xfail_reason(mode):
        pytest.skip(f"known problem: {c.xfail_reason(mode)}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = run_nonfinite(c)
    if c.expected(mode) == CONVERTS:
        assert o.status == "match", f"{c.name}: {o.status}\n{o.message}"
    else:
        assert o.status == "refused", f"{c.name}: {o.status}\n{o.message}"


def test_corpus_shape():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
    assert len(OF_THE_KIND) >= 100, len(OF_THE_KIND)
    for c in CASES:
        assert c.modes and set(c.modes) <= {"eval", "train"}, c.name
        for mode in c.modes:
            assert c.expected(mode) in (CONVERTS, REFUSED), f"{c.name} {mode}: no expectation"
        if c.module == "out_of_scope":
            assert all(c.expected(m) == REFUSED for m in c.modes), c.name
        assert 1 in c.batches or "eval" in c.modes, f"{c.name}: no batch-1 run"
        for b in (1, 4):
            model, inputs = harness.build(c, 0, b)
            assert isinstance(model, c.cls) and isinstance(inputs, tuple), c.name
            x = inputs[0]
            assert x.shape[0] == b or c.name in ("WLPHead", "FastText"), (c.name, x.shape)


# --------------------------------------------------------------------------------------
# the harness itself: it must see a wrong answer, a stale parameter, a bad refusal
# --------------------------------------------------------------------------------------
def _case(name):
    return next(c for c in CASES if c.name == name)


class _Off:
    """A 'fused' model that is the eager model plus a small error."""

    def __init__(self, model, delta=1e-3, nan=False):
        self.model, self.delta, self.nan = model, delta, nan

    def __call__(self, *args):
        out = self.model(*args)
        out = out + self.delta
        if self.nan:
            out = out.clone()
            out.view(-1)[0] = float("nan")
        return out


@pytest.mark.parametrize("kind", ["offset", "nan"])
def test_harness_sees_wrong_answers(monkeypatch, kind):
    monkeypatch.setattr(cupyfuse, "from_model",
                        lambda m: _Off(m, 1e-3 if kind == "offset" else 0.0, nan=kind == "nan"))
    o = run_case(_case("TitanicNet"), "eval")
    assert o.status == "mismatch", o
    with pytest.raises(pytest.fail.Exception, match="WRONG ANSWER"):
        check_outcome(_case("TitanicNet"), "eval", o)


def test_harness_sees_stale_parameters(monkeypatch):
    """The reference is updated between the two batches and the fused model is not."""
    orig = harness.perturb

    def ref_only(owner, ref_model, seed):
        import copy
        orig(copy.deepcopy(ref_model), ref_model, seed)

    monkeypatch.setattr(harness, "perturb", ref_only)
    o = run_case(_case("CosineClassifier"), "eval")
    assert o.status == "mismatch" and "batch 5" in o.message, o


def test_harness_sees_train_buffers(monkeypatch):
    """BatchNorm in train mode: a 'fused' model that computes on a copy leaves the
    running statistics of the model it was made from alone."""
    import copy
    monkeypatch.setattr(cupyfuse, "from_model", lambda m: copy.deepcopy(m))
    o = run_case(_case("TabularMLP_nodrop"), "train")
    assert o.status == "mismatch" and "buffer" in o.message, o


def test_harness_refusals_and_errors(monkeypatch):
    c = _case("TitanicNet")

    def raising(exc):
        def f(m):
            def call(*a):
                raise exc
            return call
        return f

    monkeypatch.setattr(cupyfuse, "from_model", raising(RuntimeError("boom")))
    o = run_case(c, "eval")
    assert o.status == "error"
    with pytest.raises(pytest.fail.Exception, match="other than TailError"):
        check_outcome(c, "eval", o)
    monkeypatch.setattr(cupyfuse, "from_model", raising(TailError("X: cannot fuse `foo`: no")))
    o = run_case(c, "eval")
    assert o.status == "refused" and refusal_problem(o.message) == "the message names no source line"
    good = "X: cannot fuse `foo`: no\n  at /a/b.py:12 in forward: y = foo(h)"
    assert refusal_problem(good) is None
    assert refusal_problem("X: the forward returns several values\n  at /a/b.py:3 in forward: "
                           "def forward(self, x):") is None
    with pytest.raises(AssertionError, match="expected to convert"):
        check_outcome(c, "eval", Outcome("refused", message=good))
    with pytest.raises(AssertionError, match="update its expectation"):
        check_outcome(_case("ConvHead"), "eval", Outcome("match"))


# --------------------------------------------------------------------------------------
# a training loop's target-network update written through .data (DQN/SAC/TD3 soft updates)
# --------------------------------------------------------------------------------------
# (derived weights too: a Linear weight computed from parameters, a cosine classifier's
# normalised weight, a merged LoRA weight, cached on the tensors: cupyfuse.tracking)


@pytest.mark.parametrize("name, mode", [
    pytest.param("TD3Actor", "eval"),
    pytest.param("DuelingHead", "train"),
    pytest.param("NoisyDQN", "train"),
    pytest.param("CosineClassifier", "eval"),
    pytest.param("MergedLoRALinear", "eval"),
])
def test_soft_update_through_data(name, mode):
    c = _case(name)
    model, (x,) = harness.build(c, 0, 5)
    model.train(mode == "train")
    fm = cupyfuse.from_model(model)
    tau = 0.5
    with torch.no_grad():
        fm(x)
        g = torch.Generator().manual_seed(3)
        for p in model.parameters():   # target.data.copy_(tau * online.data + (1 - tau) * target.data)
            online = torch.randn(p.shape, generator=g)
            p.data.copy_(tau * online + (1 - tau) * p.data)
        ref = harness.to64((x,))
        import copy
        m64 = copy.deepcopy(model).double()
        want = m64(*ref)
        got = fm(x)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
