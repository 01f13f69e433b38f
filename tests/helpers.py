"""Helpers the tests share: fused copies, programs of fused models, references."""
from __future__ import annotations

import copy
from typing import Any

import torch.nn as nn

import cupyfuse
from cupyfuse.api import program


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
