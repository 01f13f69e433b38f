"""Gradients of the corpora on the CPU: every KernelBench Linear-family model that converts
(at a small size: batch 8, 48 -> 512 features; the file's other constants kept) and every
converting model of the outside corpus, fused (``fused_class`` / ``from_model``) against
float64 autograd of the original: the gradient of every float input and every parameter
after ``(out * g).sum().backward()``, within 1e-4 of the gradient's scale
(``gen.tails.assert_grad_matches``); the backward program where the model's program has
one (``config.BACKWARD_PROGRAM = "cpu"``), else torch's autograd of the recompute."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import cupyfuse
from cupyfuse import TailError, config
from corpus.kernelbench_l2.index import PROBLEMS, load
from corpus.outside import CONVERTS, all_cases
from cupyfuse.bench.model import shrink_sizes
from gen.tails import assert_grad_matches, flat_outputs, grads_of

@pytest.fixture(autouse=True)
def _backward_program(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "BACKWARD_PROGRAM", "cpu")


#: (out features 512: every GroupNorm's group count divides it)
SMALL = {"batch_size": 8, "in_features": 48, "input_size": 48, "out_features": 512,
         "hidden_size": 512, "output_size": 512}


def check_gradients(model, fused_side, fused_call, inputs, what):
    m64, m32 = copy.deepcopy(model).double(), copy.deepcopy(model)
    with torch.no_grad():
        probe = flat_outputs(copy.deepcopy(model)(*copy.deepcopy(inputs)))
    g = torch.Generator().manual_seed(1)
    gs = [torch.randn(o.shape, generator=g, dtype=torch.float64) if o.is_floating_point()
          else None for o in probe]
    if all(x is None for x in gs):
        pytest.skip("no float output to differentiate (positions only)")
    got = grads_of(fused_side, fused_call, inputs, gs, torch.float32)
    ref64 = grads_of(m64, m64, inputs, gs, torch.float64)
    ref32 = grads_of(m32, m32, inputs, gs, torch.float32)
    assert len(got) == len(ref64)
    for i, (a, b, c) in enumerate(zip(got, ref64, ref32)):
        assert_grad_matches(a, b, c, f"{what}: gradient {i}")


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("num,fname", PROBLEMS, ids=[f"kb{n}" for n, _ in PROBLEMS])
def test_kernelbench_gradients(num, fname, mode):
    mod = shrink_sizes(load(fname), SMALL)
    init = mod.get_init_inputs()
    torch.manual_seed(0)
    model = mod.Model(*init).train(mode == "train")
    fused = cupyfuse.fused_class(mod.Model)(*init).train(mode == "train")
    fused.load_state_dict(model.state_dict())
    torch.manual_seed(1)
    inputs = list(mod.get_inputs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            fused(*copy.deepcopy(inputs))
        except TailError as e:
            assert num == 66 and mode == "train", e   # active dropout: refused
            return
        fused.load_state_dict(model.state_dict())   # (BatchNorm counted that call)
        check_gradients(model, fused, fused, inputs, f"kb{num} {mode}")


def _outside_params():
    out = []
    for c in all_cases():
        for mode in c.modes:
            if c.expected(mode) == CONVERTS:
                out.append(pytest.param(c, mode, id=f"{c.name}-{mode}"))
    return out


@pytest.mark.parametrize("case,mode", _outside_params())
def test_outside_corpus_gradients(case, mode):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, inputs = case.make(cls=case.cls, batch=case.batches[-1])
        model.train(mode == "train")
        fm = cupyfuse.from_model(copy.deepcopy(model))
        check_gradients(model, fm, fm, list(inputs), f"{case.name} {mode}")
