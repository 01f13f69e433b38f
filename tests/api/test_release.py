"""A fused module, its parameters and their GPU memory are freed when the user drops the
module: by reference counting, not at some later run of Python's cyclic collector.

A fused_class instance holds its runner (traces, programs, prepared launches, the
specialised call); anything there holding the instance, its ``__dict__`` or the fx tracer
that traced it would make a reference cycle, and ``del model; torch.cuda.empty_cache()``
would then keep every parameter (and the engine's weight splits) on the GPU until a gen-2
collection. Each test runs with the cyclic collector disabled: an object still alive after
``del`` is held by a cycle (or a cache) and the test fails.

Drawn tails (tests/gen/tails.py) through each way in (fused_class, fused_copy,
from_model), called enough times for every fast path to be built on a GPU (the general
path, the prepared launch, the specialised call), on the CPU always and on the GPU where
there is one."""
from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import cupyfuse
from gen.tails import cases
from helpers import fused_copy
from helpers import examples

CUDA = torch.cuda.is_available()


class _NoCyclicGC:
    """Collect once, then keep the cyclic collector off inside the block."""

    def __enter__(self) -> None:
        gc.collect()
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was:
            gc.enable()


def _build(case, api: str, device: str):
    spec = case.spec
    model = spec.make_model(case.model_seed).to(device)
    if api == "fused_class":
        torch.manual_seed(case.model_seed)
        fused = cupyfuse.fused_class(spec.model_class())().to(device)
        fused.train(spec.mode == "train")
        return fused, fused
    if api == "fused_copy":
        fused = fused_copy(model)
        return fused, fused
    return cupyfuse.from_model(model), model


def _calls(fused, inputs, calls: int) -> None:
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for _ in range(calls):
            fused(*inputs)


def _dropped_and_freed(case, api: str, device: str, calls: int) -> None:
    spec = case.spec
    inputs = [t.to(device) for t in spec.make_inputs(case.batch, case.dist, case.data_seed)]
    # once before, collected as usual: what a first call keeps for good (the compiled
    # kernels, the workspaces kept per device and stream, torch's own first-use state) is
    # not counted below
    _calls(_build(case, api, device)[0], inputs, calls)
    with _NoCyclicGC():
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
        fused, holder = _build(case, api, device)
        _calls(fused, inputs, calls)
        refs = [weakref.ref(fused), weakref.ref(holder)] + \
            [weakref.ref(p) for p in holder.parameters()]
        del fused, holder
        alive = [r() for r in refs if r() is not None]
        assert not alive, (f"{api}: {len(alive)} of {len(refs)} objects (module, "
                           f"parameters) outlive `del` (a reference cycle): "
                           f"{[type(a).__name__ for a in alive]}\n{case!r}")
        if device == "cuda":
            torch.cuda.synchronize()
            # the inputs stay; the parameters, the outputs and the weight splits are gone
            assert torch.cuda.memory_allocated() <= base, \
                f"{api}: {torch.cuda.memory_allocated() - base} bytes still allocated\n{case!r}"


_APIS = st.sampled_from(["fused_class", "fused_copy", "from_model"])


@settings(max_examples=examples(25), deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=True)
@given(case=cases(specials=(0,), apis=("fused_class",)), api=_APIS)
def test_dropped_module_is_freed_cpu(case, api):
    _dropped_and_freed(case, api, "cpu", 2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@settings(max_examples=examples(25), deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=True)
@given(case=cases(specials=(0,), apis=("fused_class",)), api=_APIS)
def test_dropped_module_is_freed_gpu(case, api):
    # four calls: the general path, the prepared launch, the specialised call built at
    # the second hit and used at the third
    _dropped_and_freed(case, api, "cuda", 4)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_dropped_weight_of_a_function_is_freed_gpu():
    """fused_linear's prepared entry and specialised call hold a weight weakly."""
    tail = lambda h: torch.sigmoid(h).sum(dim=1)   # noqa: E731
    x = torch.rand(32, 256, device="cuda")
    with _NoCyclicGC():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        w = torch.randn(384, 256, device="cuda")
        b = torch.randn(384, device="cuda")
        for _ in range(4):
            out = cupyfuse.fused_linear(x, w, b, tail)
        torch.testing.assert_close(out.double(), tail(x.double() @ w.double().T + b.double()),
                                   atol=1e-4, rtol=1e-4)
        refs = [weakref.ref(w), weakref.ref(b)]
        del w, b, out
        assert all(r() is None for r in refs)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= base


def test_specialised_function_is_not_in_its_own_globals():
    """fastpath's generated functions die by reference counting: a function stored in its
    own globals is a cycle, and a module's specialised call holds the watched modules'
    attribute dicts (its parameters) in those globals."""
    from cupyfuse import fastpath

    w = fastpath._Writer()
    held = torch.zeros(3)
    w.emit(f"return {w.const('HELD', held)}")
    with _NoCyclicGC():
        fn = w.finish("", "a test")
        assert fn() is held and "specialised" not in fn.__globals__
        ref = weakref.ref(fn)
        t_ref = weakref.ref(held)
        del fn, w, held
        assert ref() is None and t_ref() is None


_NAMED = {"56": lambda: __import__("cupyfuse.kernelbench").kernelbench.models.MatmulSigmoidSum(64, 32),
          "55": lambda: __import__("cupyfuse.kernelbench").kernelbench.models.MatmulMaxPoolSumScale(64, 32, 2, 0.5),
          "39": lambda: __import__("cupyfuse.kernelbench").kernelbench.models.GemmScaleBatchNorm(64, 32, (32,))}


def _named_freed(which: str, convert: str, device: str) -> None:
    conv = fused_copy if convert == "nn.from_model" else cupyfuse.from_model
    x = torch.rand(8, 64, device=device)
    _calls(conv(_NAMED[which]().to(device)), [x], 4)   # (first use: see _dropped_and_freed)
    with _NoCyclicGC():
        fused = conv(_NAMED[which]().to(device))
        _calls(fused, [x], 4)
        refs = [weakref.ref(fused)] + [weakref.ref(p) for p in fused.parameters()]
        del fused
        assert all(r() is None for r in refs), f"{convert} of model {which} outlives `del`"


@pytest.mark.parametrize("convert", ["nn.from_model", "from_model"])
@pytest.mark.parametrize("which", sorted(_NAMED))
def test_named_modules_are_freed_cpu(which, convert):
    _named_freed(which, convert, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("convert", ["nn.from_model", "from_model"])
@pytest.mark.parametrize("which", sorted(_NAMED))
def test_named_modules_are_freed_gpu(which, convert):
    _named_freed(which, convert, "cuda")
