"""The four models as fused classes, and the converter.

Each named class is :func:`cupyfuse.fused_class` of the original model in
:mod:`cupyfuse.kernelbench.models` (a subclass of it, with a name and a ``precision`` attribute): the
original's ``__init__`` signature, parameters created in the original's order (the same
seed gives the same weights), the same state_dict keys (``fused.load_state_dict(
original.state_dict())`` works), train/eval behaviour, and a forward that runs the
generic tail program of the original's forward. There is no per-model code: 39's
BatchNorm updates its running statistics the way any captured ``nn.BatchNorm1d`` does.

``from_model(model)`` converts an instance: a model computing what one of the four
computes (checked on the traced programs, not on names or structure) gets that named
class; any other Linear + tail model gets a :class:`cupyfuse.api.FusedModel`. The
modules are forward-only (see :mod:`cupyfuse.interop`). ``precision`` (None, "highest",
"high", "medium"; see :mod:`cupyfuse.backend.gemm`) picks the GEMM precision.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from cupyfuse import api as fused
from cupyfuse.kernelbench import models
from cupyfuse.api import FusedModel, fused_class
from cupyfuse.ir.program import TailError

__all__ = [
    "FusedMatmulMaxPoolSumScale", "FusedMatmulSigmoidSum", "FusedMatmulAvgPoolGeluScaleMax",
    "FusedGemmScaleBatchNorm", "from_model", "fused_class", "FusedModel",
]


def _same_program(a: Any, b: Any) -> bool:
    if a.nodes != b.nodes or a.out != b.out or a.more_outs != b.more_outs or \
            a.outs_type != b.outs_type or a.lead_out != b.lead_out or \
            a.more_lead_out != b.more_lead_out or \
            a.n_inputs != b.n_inputs or \
            a.squeezes_batch != b.squeezes_batch or len(a.sources) != len(b.sources):
        return False
    for x, y in zip(a.sources, b.sources):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                    and x.shape == y.shape and torch.equal(x.cpu(), y.cpu())):
                return False
        elif x != y:
            return False
    return True


def _programs(model: nn.Module, forward_of: type, K: int) -> Any:
    """The tail program of ``forward_of.forward`` run over ``model``'s own attributes (a
    shell sharing its ``__dict__``: nothing is copied) for a (2, K) input."""
    from cupyfuse.frontend import trace as tracing, translate as translation

    shell = forward_of.__new__(forward_of)
    object.__setattr__(shell, "__dict__", model.__dict__)
    traced = tracing.trace(shell, forward_of.__name__)
    return translation.translate(traced, shell, [(2, K)])


def _layout(model: nn.Module) -> tuple:
    """Submodule names and types (the root's type aside) with the names of each one's
    plain attributes: what a forward can read besides tensors."""
    out = []
    for name, m in model.named_modules():
        attrs = tuple(sorted(k for k, v in m.__dict__.items()
                             if isinstance(v, fused._SCALARS) and not k.startswith("_")
                             and not k.startswith("cupyfuse_")))
        out.append((name, type(m) if name else None, attrs))
    return tuple(sorted(out, key=lambda t: t[0]))


_layouts: dict[type, tuple] = {}


def _original_layout(original: type) -> tuple:
    lay = _layouts.get(original)
    if lay is None:
        key = next(k for k, p in models.PROBLEMS.items() if p.model is original)
        with torch.device("meta"):
            lay = _layouts[original] = _layout(original(*models.get_init_inputs(key, "small")))
    return lay


class _Named:
    """What the named classes add to their ``fused_class``: a ``precision`` attribute
    and ``from_model``."""

    _original: type = nn.Module

    @property
    def precision(self) -> str | None:
        """GEMM precision (None follows torch's setting)."""
        return self.__dict__.get("cupyfuse_precision")

    @precision.setter
    def precision(self, value: str | None) -> None:
        self.__dict__["cupyfuse_precision"] = value

    @classmethod
    def computes_the_same(cls, model: nn.Module) -> bool:
        """Whether ``model`` has the original's submodules and plain attributes (names and
        types: a later change to one the original does not read would go unseen) and its
        forward is the original's program, in train and in eval mode, over them."""
        if isinstance(model, cls) or type(model) is cls._original:
            return True
        own = getattr(type(model), "_cupyfuse_base", type(model))
        if own is cls._original:
            return True
        if not isinstance(model, nn.Module) or isinstance(model, FusedModel):
            return False
        if _layout(model) != _original_layout(cls._original):
            return False
        lin = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
        if lin is None:
            return False
        flags = [(m, m.training) for m in model.modules()]
        try:
            with fused._trace_lock:
                for mode in (model.training, not model.training):
                    model.train(mode)
                    mine = _programs(model, own, lin.in_features)
                    theirs = _programs(model, cls._original, lin.in_features)
                    if not _same_program(mine, theirs):
                        return False
            return True
        except Exception:   # the original's forward does not run over this model
            return False
        finally:
            for m, t in flags:
                m.training = t

    @classmethod
    def from_model(cls, model: nn.Module, precision: str | None = None) -> Any:
        """A fused copy of ``model`` (weights deep-copied, same train/eval flags), which
        must compute what the original computes (see :meth:`computes_the_same`)."""
        if not cls.computes_the_same(model):
            raise TailError(f"{cls.__name__}.from_model: {type(model).__name__}'s forward is not "
                            f"{cls._original.__name__}'s computation over the same attributes; "
                            "cupyfuse.kernelbench.modules.from_model(model) fuses it as it is")
        new = fused.fused_copy(model, cls, precision)
        return new


class FusedMatmulMaxPoolSumScale(_Named, fused_class(models.MatmulMaxPoolSumScale)):
    """Fused model 55. ``forward(x)``: (batch, in_features) -> (batch,)."""

    _original = models.MatmulMaxPoolSumScale


class FusedMatmulSigmoidSum(_Named, fused_class(models.MatmulSigmoidSum)):
    """Fused model 56. ``forward(x)``: (batch, input_size) -> (batch, 1)."""

    _original = models.MatmulSigmoidSum


class FusedMatmulAvgPoolGeluScaleMax(_Named, fused_class(models.MatmulAvgPoolGeluScaleMax)):
    """Fused model 98. ``forward(x)``: (batch, in_features) -> (batch,)."""

    _original = models.MatmulAvgPoolGeluScaleMax


class FusedGemmScaleBatchNorm(_Named, fused_class(models.GemmScaleBatchNorm)):
    """Fused model 39. ``forward(x)``: (batch, in_features) -> (batch, out_features).

    Honours ``train()``/``eval()`` like ``nn.BatchNorm1d``: training mode normalises with
    batch statistics and updates ``bn.running_mean``/``bn.running_var`` (momentum, or a
    cumulative average when ``bn.momentum`` is None) and ``bn.num_batches_tracked``; the
    BatchNorm's own flag decides (a frozen ``bn`` inside a training model stays frozen).
    """

    _original = models.GemmScaleBatchNorm


NAMED = (FusedMatmulMaxPoolSumScale, FusedMatmulSigmoidSum, FusedMatmulAvgPoolGeluScaleMax,
         FusedGemmScaleBatchNorm)


def from_model(model: nn.Module, precision: str | None = None) -> nn.Module:
    """Fused replacement for any Linear + tail model.

    A model whose forward computes what one of the four originals computes (its traced
    program, in train and eval mode, is the original's over the same attributes) gets
    that named class: a copy with the model's weights and buffers, on its device. Any
    other module whose forward is a Linear + tail (or a chain of them) gets a
    :class:`cupyfuse.api.FusedModel` sharing the model's own parameters and buffers; an
    op outside the vocabulary raises :class:`cupyfuse.TailError` (a ``ValueError``)
    naming the op and its source line, at the first call (when the input shapes are
    known). A forward torch.fx cannot trace raises it at once.
    """
    if isinstance(model, NAMED):
        out = copy.deepcopy(model)
        if precision is not None:
            out.precision = precision
        return out
    if isinstance(model, FusedModel):
        return model
    for cls in NAMED:
        if cls.computes_the_same(model):
            return cls.from_model(model, precision)
    return fused.from_model(model, precision)
