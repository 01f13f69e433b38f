"""The four models as fused classes: ``fused_class`` of each original in
:mod:`cupyfuse.kernelbench.models`, with a name and a ``precision`` attribute.

Each has the original's ``__init__`` signature, creates its parameters in the
original's order (the same seed gives the same weights), has the same state_dict keys
(``fused.load_state_dict(original.state_dict())`` works), the same train/eval behaviour,
and a forward that runs the generic tail program of the original's forward: there is no
per-model code (39's BatchNorm updates its running statistics the way any captured
``nn.BatchNorm1d`` does). To fuse an existing instance, use :func:`cupyfuse.from_model`.
"""
from __future__ import annotations

from cupyfuse.api import fused_class
from cupyfuse.kernelbench import models

__all__ = ["FusedMatmulMaxPoolSumScale", "FusedMatmulSigmoidSum", "FusedMatmulAvgPoolGeluScaleMax",
           "FusedGemmScaleBatchNorm", "NAMED"]


class _Named:
    """What the named classes add to their ``fused_class``: a ``precision`` attribute."""

    @property
    def precision(self) -> str | None:
        """GEMM precision (None follows torch's setting)."""
        return self.__dict__.get("cupyfuse_precision")

    @precision.setter
    def precision(self, value: str | None) -> None:
        self.__dict__["cupyfuse_precision"] = value


class FusedMatmulMaxPoolSumScale(_Named, fused_class(models.MatmulMaxPoolSumScale)):
    """Fused model 55. ``forward(x)``: (batch, in_features) -> (batch,)."""


class FusedMatmulSigmoidSum(_Named, fused_class(models.MatmulSigmoidSum)):
    """Fused model 56. ``forward(x)``: (batch, input_size) -> (batch, 1)."""


class FusedMatmulAvgPoolGeluScaleMax(_Named, fused_class(models.MatmulAvgPoolGeluScaleMax)):
    """Fused model 98. ``forward(x)``: (batch, in_features) -> (batch,)."""


class FusedGemmScaleBatchNorm(_Named, fused_class(models.GemmScaleBatchNorm)):
    """Fused model 39. ``forward(x)``: (batch, in_features) -> (batch, out_features).

    Honours ``train()``/``eval()`` like ``nn.BatchNorm1d``: training mode normalises with
    batch statistics and updates ``bn.running_mean``/``bn.running_var`` (momentum, or a
    cumulative average when ``bn.momentum`` is None) and ``bn.num_batches_tracked``; the
    BatchNorm's own flag decides (a frozen ``bn`` inside a training model stays frozen).
    """


NAMED = (FusedMatmulMaxPoolSumScale, FusedMatmulSigmoidSum, FusedMatmulAvgPoolGeluScaleMax,
         FusedGemmScaleBatchNorm)
