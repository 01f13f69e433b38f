"""Small helpers the model tests share: a quiet call and the float64 / float32 references."""
from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.nn as nn


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
