"""Helpers the tests share: the device parameter, quiet calls and float64 references,
fused copies, programs and runners of fused modules."""
from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

import cupyfuse
from cupyfuse.api import program
from cupyfuse.interop import cupy_available

#: the device parameter of tests that run on the CPU and, marked ``gpu``, on the GPU
GPU = pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and cupy_available()),
                       reason="needs a CUDA GPU visible to both torch and CuPy")])
DEVICES = ["cpu", GPU]

#: the hypothesis profile: "ci" (the default: every property test draws the examples it
#: names, derandomized) or "thorough" (HYPOTHESIS_PROFILE=thorough: ten times as many)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "thorough"):
    raise ValueError(f"HYPOTHESIS_PROFILE={PROFILE!r}: use 'ci' (the default) or 'thorough'")


def examples(n: int) -> int:
    """The ``max_examples`` of a property test that draws ``n`` under the ci profile."""
    return n * (10 if PROFILE == "thorough" else 1)


def property_settings(n: int) -> Any:
    """hypothesis settings of a property test drawing ``n`` examples under the ci profile
    (derandomized, no deadline, no database; the health checks of whole drawn models off)."""
    from hypothesis import HealthCheck, settings

    return settings(max_examples=examples(n), deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def quiet(fn: Any, *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)`` under no_grad with warnings silenced (the forward-only warning
    of a fused call in grad mode, torch's own)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            return fn(*args, **kw)


def refs(model: nn.Module, inputs: tuple) -> tuple:
    """(float64 output, float32 torch output) of ``model`` on ``inputs``, each on a deep
    copy (a train-mode BatchNorm's statistics stay untouched); integer and boolean inputs
    stay as they are."""
    m64 = copy.deepcopy(model).double()
    ref64 = quiet(m64, *[t.double() if t.is_floating_point() else t for t in inputs])
    ref32 = quiet(copy.deepcopy(model), *inputs)
    return ref64, ref32


def fused_copy(model: nn.Module, precision: str | None = None) -> nn.Module:
    """A fused module with parameters of its own (``from_model`` of a deep copy)."""
    return cupyfuse.from_model(copy.deepcopy(model), precision)


def program_of(model: nn.Module, *inputs: Any) -> Any:
    """The tail program ``cupyfuse.from_model(model)`` runs for these inputs."""
    fused = model if is_fused(model) else cupyfuse.from_model(model)
    return program(fused, *inputs)


def is_fused(m: Any) -> bool:
    """Whether ``m`` is a fused module (from ``from_model`` or ``fused_class``)."""
    return getattr(type(m), "_cupyfuse_base", None) is not None


def runner_of(m: Any) -> Any:
    """The runner of a fused module (its programs, prepared launches, specialised call)."""
    return m.__dict__["_cupyfuse_runner"]
