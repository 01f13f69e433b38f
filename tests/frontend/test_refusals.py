"""Refusals by reason: each model below runs in torch, and cupyfuse refuses it with a
TailError that names the op, says why (the reason text of its refusal site in the front
end, cupyfuse/frontend/, or of the Builder in cupyfuse/ir/program.py) and quotes the
forward's line. (tests/frontend/test_tails.py's REFUSALS pins the op names and lines of
more; this file pins the reasons.) WHOLE holds the refusals of a forward as a whole (its
inputs, its result, an augmented assignment, no Linear), which name no op and, but for the
augmented assignment, quote no line of the forward (the line that called the fused model
instead); TAILS the two sites only fused_linear's tail functions reach. Some models reach
their site only because the test's batch size is 4 (a parameter or a channel count of 4
meets the batch dimension): a forward written for a fixed batch does that.

Every refusal site of the front end, of the Builder and of the runner has a case here, or
one elsewhere (the trace failure and the unknown functions and methods in
tests/frontend/test_tails.py, a CudaTail on the CPU in tests/api/test_api.py), except those
no forward that torch (2.13) runs reaches:
- torch rejects first (cupyfuse refuses them too, at its first call): a Linear of the
  wrong width, CELU with alpha 0, F.batch_norm with momentum=None, split sections that do
  not add up, GLU of an odd dim, pooling or InstanceNorm of a 1-D value, shapes that do not
  broadcast, a dim out of range, a pool kernel or stride below 1 or longer than the
  features, GroupNorm groups that do not divide the channels (checked on dim 1 as torch
  does: F.group_norm of a transposed value is GroupNormTransposed's refusal);
- another check comes first: a float64 tensor constant (the trace makes it a get_attr, whose
  dtype is refused: DoubleBuffer), a shape element that is not an int (torch rejects other
  types; a computed size is refused: ReshapeComputedSize, LayerNormComputedShape),
  a Linear's input that is not (batch, in_features) (the translator views it so first; one
  without the batch dim is LinearOfParameter's refusal), BatchNorm updating running stats in a
  tail function (a tail cannot call a module; F.batch_norm doing it is refused first);
- reached only through a transpose of a value, which is refused first (it would move
  data between rows): addmm's second matrix as a value, PReLU/LayerNorm/pooling/GroupNorm
  over the batch dim (AddmmOfValues, PReLUOverBatch, LayerNormOverBatch, PoolOverBatch and
  GroupNormTransposed pin the transpose's refusal);
- cat of a sequence other than a literal list/tuple or chunk/split pieces (the cat of
  chunks it was reached by is fused: tests/frontend/test_tails.py's _ChunkPieces);
- internal: a forward that returns nothing (a traced graph always has an output), an
  elementwise op with the wrong operand count, and the reduction kind under
  `# pragma: no cover`."""
from __future__ import annotations

import copy
import inspect
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cupyfuse import fused_class, fused_linear
from cupyfuse.api import from_model
from cupyfuse.ir.program import TailError

THIS = Path(__file__).name


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)


class SoftmaxNoDim(_Base):
    def forward(self, x):
        h = self.fc(x)
        return F.softmax(h.unsqueeze(1)).squeeze(1)   # (torch's legacy dim 0: the batch)


class DivRounding(_Base):
    def forward(self, x):
        h = self.fc(x)
        return torch.div(h, 2.0, rounding_mode="floor")


class NumberPower(_Base):
    def forward(self, x):
        h = self.fc(x)
        return 2.0 ** h


class WholeMean(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h - h.mean()


class Expand(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.randn(6))

    def forward(self, x):
        h = self.fc(x)
        return h * self.v.expand(h.shape[0], -1).sum(1, keepdim=True)


class PoolIndices(_Base):
    def forward(self, x):
        h = self.fc(x)
        return F.max_pool1d(h.unsqueeze(1), 2, padding=1, return_indices=True)[0].squeeze(1)


class FlattenAll(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h.reshape(-1)


class BatchSlice(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h[1:, :]


class BoolCompare(_Base):
    def forward(self, x):
        h = self.fc(x)
        return ((h > 0) == (h < 1)).float()


class WhereIndices(_Base):
    def forward(self, x):
        h = self.fc(x)
        return torch.where(h > 0)[0]


class SoftminNoDim(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.sm = nn.Softmin()

    def forward(self, x):
        h = self.fc(x)
        return self.sm(h[:, None])[:, 0]


class InstanceNormStats(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.InstanceNorm1d(1, track_running_stats=True)

    def forward(self, x):
        h = self.fc(x)
        return self.norm(h.unsqueeze(1)).squeeze(1)


class MaxIndices(_Base):   # (the indices themselves convert: int64)
    def forward(self, x):
        h = self.fc(x)
        return h.max(dim=1)[1] * 2


class BoolArithmetic(_Base):
    def forward(self, x):
        h = self.fc(x)
        return ((h > 0) + (h < 1)).float()


class ActiveDropout(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = self.fc(x)
        return self.drop(h)


class BoolReduction(_Base):
    def forward(self, x):
        h = self.fc(x)
        return (h > 0).sum(1).float()


class FloatCondition(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tensor([True, False] * 3))

    def forward(self, x):
        h = self.fc(x)
        return torch.where(self.mask, h, torch.zeros_like(h))


class LogicalOfFloat(_Base):
    def forward(self, x):
        h = self.fc(x)
        return torch.logical_and(h, h > 0).float()


class SteppedSlice(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h[:, ::2]


class EmptySlice(_Base):
    def forward(self, x):
        h = self.fc(x)
        return torch.cat([h[:, 3:3], h], dim=1)


class RReLUTraining(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.RReLU()

    def forward(self, x):
        h = self.fc(x)
        return self.act(h)


class AdaptiveIndices(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AdaptiveMaxPool1d(3, return_indices=True)

    def forward(self, x):
        h = self.fc(x)
        return self.pool(h.unsqueeze(1))[0].squeeze(1)


class BatchNormFnUpdates(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rm", torch.zeros(6))
        self.register_buffer("rv", torch.ones(6))

    def forward(self, x):
        h = self.fc(x)
        return F.batch_norm(h, self.rm, self.rv, training=True, momentum=0.1)


class BatchSizeAsNumber(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h * h.shape[0]


class DoubleCast(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h.to(torch.float64).sum(1).float()


class MatrixParam(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.m = nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        h = self.fc(x)
        return h.unsqueeze(1) * self.m


class BatchShape(_Base):
    def forward(self, x):
        h = self.fc(x)
        return F.layer_norm(h, h.shape)


class BoolResult(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h > 0


class MatmulWithValue(_Base):
    def forward(self, x):
        h = self.fc(x)
        return torch.matmul(h, h.unsqueeze(-1))


class EinsumTwoValues(_Base):
    def forward(self, x):
        h = self.fc(x)
        return torch.einsum("bi,bi->b", h, h)


# --- more sites of the front end --------------------------------------------------
class BoolOperand(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h + True


class ComplexScalar(_Base):
    def forward(self, x):
        h = self.fc(x)
        return (h * 1j).abs()


class ClampToBatchSize(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h.clamp(max=h.shape[0])


class DoubleBuffer(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale64", torch.full((6,), 2.0, dtype=torch.float64))

    def forward(self, x):
        h = self.fc(x)
        return (h * self.scale64).float()


class SoftmaxModuleNoDim(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.sm = nn.Softmax()

    def forward(self, x):
        h = self.fc(x)
        return self.sm(h.unsqueeze(-1)).squeeze(-1)


class OtherModule(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.LPPool1d(2, 2)

    def forward(self, x):
        h = self.fc(x)
        return self.pool(h.unsqueeze(1)).squeeze(1)


class OtherAttribute(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h.real.t()


class AddmmOfValues(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.randn(4))

    def forward(self, x):
        h = self.fc(x)
        return torch.addmm(self.b, h, h.t())


class LinearFnValueWeight(_Base):
    def forward(self, x):
        h = self.fc(x)
        return F.linear(h, h)


class LinearFnValueBias(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 6))
        self.b = nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = self.fc(x)
        # (a bias of the module's tensors alone, ``self.b * 2.0``, is a derived weight)
        return F.linear(h, self.w, self.b + h[:, :3])


class PReLUValueWeight(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.full((6,), 0.25))

    def forward(self, x):
        h = self.fc(x)
        return F.prelu(h, self.a * 2.0)


class LikeOtherDtype(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h + torch.zeros_like(h, dtype=torch.float16)


class SoftminFnNoDim(_Base):
    def forward(self, x):
        h = self.fc(x)
        return F.softmin(h[:, :, None])[..., 0]


class Fmax(_Base):
    def forward(self, x):
        h = self.fc(x)
        return torch.fmax(h, h * 2.0)


class BoolMoved(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h * (h > 0).to("cpu")


class NormWeightValue(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(6))

    def forward(self, x):
        h = self.fc(x)
        return F.layer_norm(h, (6,), self.w * 2.0)


class LogsumexpTwoDims(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h - torch.logsumexp(h, dim=(0, 1))


class EinsumThreeOperands(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 6))
        self.v = nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = self.fc(x)
        return torch.einsum("bi,oi,o->bo", h, self.w, self.v)


class EinsumTransposedOut(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 6))

    def forward(self, x):
        h = self.fc(x)
        return torch.einsum("bi,oi->ob", h, self.w).t()


class TwoEllipses(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h[..., ...]


class BatchRowIndex(_Base):
    """An integer index of the batch dim (h[:, None] and h[:, 0] are fused:
    tests/frontend/test_tails.py's _tail_new_axes)."""

    def forward(self, x):
        h = self.fc(x)
        return h - h[0]


class ChunkBatch(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h.chunk(2, dim=0)[0]


class PReLUOverBatch(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.PReLU(4)   # 4 channels: the batch size of the test

    def forward(self, x):
        h = self.fc(x)
        return self.act(h.t()).t()


class LayerNormOverBatch(_Base):
    def forward(self, x):
        h = self.fc(x)
        return F.layer_norm(h.t(), (4,)).t()


class BatchNormOf3d(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(1)

    def forward(self, x):
        h = self.fc(x)
        return self.bn(h.unsqueeze(1)).squeeze(1)


class BatchNormFnOf3d(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rm", torch.zeros(1))
        self.register_buffer("rv", torch.ones(1))

    def forward(self, x):
        h = self.fc(x)
        return F.batch_norm(h.unsqueeze(1), self.rm, self.rv).squeeze(1)


class FlattenFn(_Base):
    def forward(self, x):
        h = self.fc(x)
        return torch.flatten(h)


class ReshapeToDimCount(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h.reshape(-1, h.dim()).sum(1)


class ReshapeBatchTwice(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h.reshape(h.size(0), h.size(0), -1).sum(1)


class ReshapeSplitFeatures(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h.reshape(h.shape[0], 2, 3).transpose(1, 2).sum(2)


class ReshapeFlat(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h.reshape(24)


class ReshapeRows(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h.reshape(-1, 6, 2).sum(2)


# --- sites of the Builder (program.py) ------------------------------------------------
class BroadcastBatch(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(4, 1))   # 4 rows: the batch size of the test

    def forward(self, x):
        h = self.fc(x)
        return h * self.p


class TwoBatchDims(_Base):
    def forward(self, x):
        h = self.fc(x)
        return (h.unsqueeze(1) + h.unsqueeze(0)).sum(1)


class NarrowBatch(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h.narrow(0, 1, 2)


class NarrowEmpty(_Base):
    def forward(self, x):
        h = self.fc(x)
        return torch.cat([h.narrow(1, 2, 0), h], 1)


class CatBatch(_Base):
    def forward(self, x):
        h = self.fc(x)
        return torch.cat([h, h], 0)


class CatWithBatchSizedParam(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(4, 1))   # 4 rows: the batch size of the test

    def forward(self, x):
        h = self.fc(x)
        return torch.cat([h, self.p], 1)


class CatOfParams(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(2))
        self.b = nn.Parameter(torch.randn(4))

    def forward(self, x):
        h = self.fc(x)
        return h * torch.cat([self.a, self.b])


class CatAcrossFeatures(_Base):
    def forward(self, x):
        h = self.fc(x)
        return torch.cat([h.unsqueeze(1), h.unsqueeze(1)], 1).sum(1)


class SumOverBatch(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h - h.sum(0)


class PoolOverBatch(_Base):
    def forward(self, x):
        h = self.fc(x)
        return F.max_pool1d(h.t(), 2).t()


class MeanOverBatch(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h - h.mean(0)


class SoftmaxOverBatch(_Base):
    def forward(self, x):
        h = self.fc(x)
        return torch.log_softmax(h, 0) + h.softmax(dim=1)


class NormNuc(_Base):
    def forward(self, x):
        h = self.fc(x)
        return torch.norm(h.view(-1, 2, h.shape[1] // 2), p="nuc", dim=(1, 2))


class BatchNormOfParam(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(6, 1))

    def forward(self, x):
        h = self.fc(x)
        return h * F.batch_norm(self.p, None, None, training=True).t()


class GroupNormTransposed(_Base):
    """torch groups dim 1 of (6, batch): the batch rows; fused as if over features, it
    would be a silently wrong result."""

    def forward(self, x):
        h = self.fc(x)
        return F.group_norm(h.t(), 2).t()


class SqueezeThenMore(_Base):
    """squeeze() of the batch dim before more ops (at batch 1 torch works on a batch-less
    tensor from there); as the last op it is fused (tests/frontend/test_tails.py)."""

    def forward(self, x):
        h = self.fc(x)
        return h.squeeze() * 2.0


class SoftmaxOverTransposed(_Base):
    """Over the batch dim through a transpose: a permute read as a relabelling view would
    fuse it with scrambled values."""

    def forward(self, x):
        h = self.fc(x)
        return h.t().softmax(0).t()


class InplaceOnSlice(_Base):
    """An in-place op on a slice of h changes h: never dropped silently."""

    def forward(self, x):
        h = self.fc(x)
        h[:, :2].relu_()
        return h


class InplaceOnInputView(_Base):
    def forward(self, x):
        x.narrow(1, 0, 2).mul_(3)
        return self.fc(x)


class ViewReadAfterInplace(_Base):
    def forward(self, x):
        h = self.fc(x)
        v = h[:, :2]
        h.relu_()
        return v


class SumEmptyDims(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h + h.sum(dim=())


class SoftmaxFloat64(_Base):
    def forward(self, x):
        h = self.fc(x)
        return F.softmax(h, dim=1, dtype=torch.float64)


class SumFloat64(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h.sum(1, dtype=torch.float64)


class LinearOfParameter(nn.Module):
    """A Linear applied to a parameter (no batch dim): refused, not a crash at run
    time."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.v = nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = self.fc(x)
        return h + self.fc(self.v)


class ReshapeComputedSize(_Base):
    """A size computed from the shape: the size itself, not its program value id (which
    would refuse it for the wrong reason, or fuse it where the id happened to match)."""

    def forward(self, x):
        h = self.fc(x)
        return h.reshape(-1, h.shape[1] * 1)


class LayerNormComputedShape(_Base):
    def forward(self, x):
        h = self.fc(x)
        return F.layer_norm(h, (h.shape[1] * 1,))


class ParameterTwoFeatureDims(nn.Module):
    """A parameter with two feature dims: its refusal quotes a line."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.m = nn.Parameter(torch.randn(1, 6, 6))

    def forward(self, x):
        h = self.fc(x)
        return (h.unsqueeze(1) * self.m).sum(2)


CASES = [
    # (model, op named, reason fragment, code of the line quoted)
    (ParameterTwoFeatureDims, "parameter", "two feature dimensions",
     "(h.unsqueeze(1) * self.m).sum(2)"),
    (LinearOfParameter, "fc", "without the batch dimension", "return h + self.fc(self.v)"),
    (GroupNormTransposed, ".t()", "moves the batch dim", "F.group_norm(h.t(), 2).t()"),
    (SoftmaxOverTransposed, ".t()", "moves the batch dim", "h.t().softmax(0).t()"),
    (SqueezeThenMore, "squeeze", "squeeze() of the batch dim", "return h.squeeze() * 2.0"),
    (InplaceOnSlice, "relu_", "a view of a value that is read again later", "h[:, :2].relu_()"),
    (InplaceOnInputView, "mul_", "a view of a value that is read again later",
     "x.narrow(1, 0, 2).mul_(3)"),
    (ViewReadAfterInplace, "relu_", "a view of a value that is read again later",
     "h.relu_()"),
    (SumEmptyDims, "sum", "no dim", "h + h.sum(dim=())"),
    (SoftmaxFloat64, "softmax", "dtype=torch.float64",
     "F.softmax(h, dim=1, dtype=torch.float64)"),
    (SumFloat64, "sum", "dtype=torch.float64", "h.sum(1, dtype=torch.float64)"),
    (SoftmaxNoDim, "softmax", "without an explicit dim", "F.softmax(h.unsqueeze(1)).squeeze(1)"),
    (DivRounding, "div", "rounding_mode='floor'", 'torch.div(h, 2.0, rounding_mode="floor")'),
    (NumberPower, "pow", "a number raised to a tensor power", "2.0 ** h"),
    (WholeMean, "mean", "no dim", "h - h.mean()"),
    (Expand, "sum", "such an expand only where an elementwise op broadcasts it",
     "h * self.v.expand(h.shape[0], -1).sum(1, keepdim=True)"),
    (PoolIndices, "max_pool1d", "indices",
     "F.max_pool1d(h.unsqueeze(1), 2, padding=1, return_indices=True)"),
    (FlattenAll, "reshape", "batch", "h.reshape(-1)"),
    (BatchSlice, "slicing", "slices the batch dimension", "h[1:, :]"),
    (BoolCompare, "eq", "a comparison of boolean tensors", "((h > 0) == (h < 1)).float()"),
    (WhereIndices, "where", "indices", "torch.where(h > 0)[0]"),
    (SoftminNoDim, "sm", "softmin without an explicit dim", "self.sm(h[:, None])[:, 0]"),
    (InstanceNormStats, "norm", "InstanceNorm with track_running_stats=True",
     "self.norm(h.unsqueeze(1)).squeeze(1)"),
    (MaxIndices, "mul", "uses the positions argmax/argmin", "h.max(dim=1)[1] * 2"),
    (BoolArithmetic, "add", "arithmetic between two boolean tensors", "((h > 0) + (h < 1))"),
    (ActiveDropout, "drop", "active dropout (p=0.5 in training mode) is random", "self.drop(h)"),
    (BoolReduction, "sum", "a reduction of a boolean tensor", "(h > 0).sum(1).float()"),
    (FloatCondition, "where", "a condition that is not a comparison of tensors",
     "torch.where(self.mask, h, torch.zeros_like(h))"),
    (LogicalOfFloat, "logical_and", "a logical op of a non-boolean operand",
     "torch.logical_and(h, h > 0)"),
    (SteppedSlice, "slic", "only plain slices of the features", "h[:, ::2]"),
    (EmptySlice, "slic", "an empty slice", "torch.cat([h[:, 3:3], h], dim=1)"),
    (RReLUTraining, "act", "RReLU in training mode draws random slopes", "self.act(h)"),
    (AdaptiveIndices, "pool", "adaptive pooling with indices",
     "self.pool(h.unsqueeze(1))[0].squeeze(1)"),
    (BatchNormFnUpdates, "batch_norm", "F.batch_norm updating running stats",
     "F.batch_norm(h, self.rm, self.rv, training=True, momentum=0.1)"),
    (BatchSizeAsNumber, "mul", "uses the batch size as a number", "h * h.shape[0]"),
    (DoubleCast, "to", "converts to another dtype", "h.to(torch.float64).sum(1).float()"),
    (MatrixParam, "mul", "uses a matrix parameter outside a matmul", "h.unsqueeze(1) * self.m"),
    (BatchShape, "layer_norm", "a shape built from the batch size", "F.layer_norm(h, h.shape)"),
    (BoolResult, "a boolean result", "the forward returns a boolean tensor", "h > 0"),
    (MatmulWithValue, "matmul", "a matmul whose second operand is not a 2-D parameter",
     "torch.matmul(h, h.unsqueeze(-1))"),
    (EinsumTwoValues, "einsum", "einsum", 'torch.einsum("bi,bi->b", h, h)'),
    # more sites of the front end
    (BoolOperand, "add", "a boolean operand", "h + True"),
    (ComplexScalar, "mul", "an operand of type complex", "(h * 1j).abs()"),
    (ClampToBatchSize, "clamp", "uses the batch size as a number", "h.clamp(max=h.shape[0])"),
    (DoubleBuffer, "scale64", "a torch.float64 tensor (cupyfuse runs float32)",
     "(h * self.scale64).float()"),
    (SoftmaxModuleNoDim, "sm (Softmax)", "softmax without an explicit dim",
     "self.sm(h.unsqueeze(-1)).squeeze(-1)"),
    (OtherModule, "pool (LPPool1d)", "not in cupyfuse's tail vocabulary",
     "self.pool(h.unsqueeze(1)).squeeze(1)"),
    (OtherAttribute, ".real", "not in cupyfuse's tail vocabulary", "h.real.t()"),
    # these reach their sites through h.t(): the transpose is refused first
    (AddmmOfValues, ".t()", "moves the batch dim", "torch.addmm(self.b, h, h.t())"),
    (LinearFnValueWeight, "F.linear", "its weight is not a 2-D parameter", "F.linear(h, h)"),
    (LinearFnValueBias, "F.linear", "its bias is not a parameter",
     "F.linear(h, self.w, self.b + h[:, :3])"),
    (PReLUValueWeight, "prelu", "its weight is not a 1-D parameter", "F.prelu(h, self.a * 2.0)"),
    (LikeOtherDtype, "zeros_like", "another dtype",
     "h + torch.zeros_like(h, dtype=torch.float16)"),
    (SoftminFnNoDim, "softmin", "softmin without an explicit dim", "F.softmin(h[:, :, None])[..., 0]"),
    (Fmax, "fmax", "not in cupyfuse's tail vocabulary", "torch.fmax(h, h * 2.0)"),
    (BoolMoved, ".to()", "a boolean tensor moved without a float32 cast", 'h * (h > 0).to("cpu")'),
    (NormWeightValue, "weight/bias", "is not a parameter or tensor",
     "F.layer_norm(h, (6,), self.w * 2.0)"),
    (LogsumexpTwoDims, "logsumexp", "this reduction over several dims at once",
     "h - torch.logsumexp(h, dim=(0, 1))"),
    (EinsumThreeOperands, "einsum", "einsum other than x with one weight",
     'torch.einsum("bi,oi,o->bo", h, self.w, self.v)'),
    (EinsumTransposedOut, "einsum", "einsum 'bi,oi->ob': not a Linear",
     'torch.einsum("bi,oi->ob", h, self.w).t()'),
    (TwoEllipses, "slicing", "more than one ellipsis", "h[..., ...]"),
    (BatchRowIndex, "slicing", "indexes the batch dimension", "return h - h[0]"),
    (ChunkBatch, "chunk", "splits the batch dimension", "h.chunk(2, dim=0)[0]"),
    (PReLUOverBatch, ".t()", "moves the batch dim", "self.act(h.t()).t()"),
    (LayerNormOverBatch, ".t()", "moves the batch dim", "F.layer_norm(h.t(), (4,)).t()"),
    (BatchNormOf3d, "bn (BatchNorm1d)", "BatchNorm1d on a value that is not (batch, features)",
     "self.bn(h.unsqueeze(1)).squeeze(1)"),
    (BatchNormFnOf3d, "batch_norm", "batch_norm on a value that is not (batch, features)",
     "F.batch_norm(h.unsqueeze(1), self.rm, self.rv).squeeze(1)"),
    (FlattenFn, "flatten", "flattening the batch and feature dims together", "torch.flatten(h)"),
    # h.dim() is a number of the forward (2): the reshape is to (-1, 2), which merges rows
    (ReshapeToDimCount, "reshape", "a reshape that merges the batch dimension",
     "h.reshape(-1, h.dim()).sum(1)"),
    (ReshapeBatchTwice, "reshape", "a reshape that uses the batch size twice",
     "h.reshape(h.size(0), h.size(0), -1).sum(1)"),
    (ReshapeSplitFeatures, "transpose",
     "reorders the dims of a (batch, 2, 3) value, which moves data within each row",
     "h.reshape(h.shape[0], 2, 3).transpose(1, 2).sum(2)"),
    (ReshapeFlat, "reshape", "the batch size is not fixed", "h.reshape(24)"),
    (ReshapeRows, "reshape", "to (-1, 6, 2) that moves data between rows or features",
     "h.reshape(-1, 6, 2).sum(2)"),
    # the Builder (program.py)
    (BroadcastBatch, "mul", "broadcasts the batch dimension against a dimension of size 4",
     "h * self.p"),
    (TwoBatchDims, "add", "makes a value with two batch dimensions",
     "(h.unsqueeze(1) + h.unsqueeze(0)).sum(1)"),
    (NarrowBatch, "narrow", "slices the batch dimension", "h.narrow(0, 1, 2)"),
    (NarrowEmpty, "narrow", "an empty slice", "torch.cat([h.narrow(1, 2, 0), h], 1)"),
    (CatBatch, "cat", "joins along the batch dimension", "torch.cat([h, h], 0)"),
    (CatWithBatchSizedParam, "cat", "differ outside the joined dimension",
     "torch.cat([h, self.p], 1)"),
    (CatOfParams, "cat", "joins values without a batch dimension",
     "h * torch.cat([self.a, self.b])"),
    (CatAcrossFeatures, "cat", "joining along one dimension of values that vary along another",
     "torch.cat([h.unsqueeze(1), h.unsqueeze(1)], 1).sum(1)"),
    (SumOverBatch, "sum", "reduces over the batch dimension (dim 0); only BatchNorm may use "
     "statistics over the batch", "h - h.sum(0)"),
    (PoolOverBatch, ".t()", "moves the batch dim", "F.max_pool1d(h.t(), 2).t()"),
    (MeanOverBatch, "mean", "mean: reduces over the batch dimension", "h - h.mean(0)"),
    (SoftmaxOverBatch, "log_softmax", "log_softmax: normalises over the batch dimension",
     "torch.log_softmax(h, 0)"),
    (NormNuc, "norm", "a norm of order 'nuc'",
     'torch.norm(h.view(-1, 2, h.shape[1] // 2), p="nuc", dim=(1, 2))'),
    (BatchNormOfParam, "batch_norm", "its input has no batch dimension",
     "h * F.batch_norm(self.p, None, None, training=True).t()"),
]


def _line_of(cls: type, code: str) -> int:
    lines, start = inspect.getsourcelines(cls.forward)
    hits = [start + i for i, ln in enumerate(lines) if code in ln]
    assert len(hits) == 1, (cls.__name__, code, hits)
    return hits[0]


@pytest.mark.parametrize("cls,op,why,code", CASES, ids=[c[0].__name__ for c in CASES])
def test_refusal_says_why(cls: type, op: str, why: str, code: str) -> None:
    torch.manual_seed(0)
    m = cls()
    x = torch.randn(4, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")   # F.softmax without dim warns in torch
        m(x)                              # torch runs it
    with pytest.raises(TailError) as ei:
        with torch.no_grad():
            from_model(m)(x)
    msg = str(ei.value)
    assert msg.startswith(f"{cls.__name__}: "), msg   # Builder refusals too
    assert op.lower() in msg.lower(), msg
    assert why in msg, msg
    assert f"{THIS}:{_line_of(cls, code)} in forward" in msg, msg
    assert code in msg, msg
    # the drop-in class refuses the same way at its first call
    fm = fused_class(cls)()
    with pytest.raises(TailError) as ei:
        with torch.no_grad():
            fm(x)
    assert why in str(ei.value), str(ei.value)


# --- refusals of the forward as a whole: its inputs, its result, its source --------------
class ReturnsWidth(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h.shape[1]


class SequenceInput(_Base):
    def forward(self, x, y):   # a (batch, seq, features) x, a (seq, features) y
        h = self.fc(x)
        return torch.relu(h) + y


class ScaledBy(_Base):
    def forward(self, x, s):
        h = self.fc(x)
        return h * s


class AugmentedAlias(_Base):
    def forward(self, x):
        h = self.fc(x)
        g = h
        g += 1.0
        return g + h


class NoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return torch.relu(x * self.p)


WHOLE = [
    # (model, input shapes, reason fragment, code of the line quoted or None: these refusals
    # name no op; those of the forward's inputs and result quote its `def` line)
    # (several results fuse, from (batch, seq, features) inputs too:
    # tests/frontend/test_several_outputs.py)
    (ReturnsWidth, [(4, 8)], "the forward does not return a tensor computed from its input",
     "def forward"),
    (SequenceInput, [(4, 2, 8), (2, 6)], "input 1 has shape (2, 6); with a (batch, 2, "
     "features) input every input must have those leading dims", "def forward"),
    (ScaledBy, [(4, 8), ()], "inputs must have a batch dimension", None),   # before the trace
    (AugmentedAlias, [(4, 8)], "cannot fuse the augmented assignment to `g`", "g += 1.0"),
    # from_model refuses it when it traces (trace.check_has_linear), the drop-in class
    # at its first call, after the translation (the translator's run)
    (NoLinear, [(4, 8)], "no Linear layer (nn.Linear, F.linear", None),
]


@pytest.mark.parametrize("cls,shapes,why,code", WHOLE, ids=[c[0].__name__ for c in WHOLE])
def test_whole_forward_refusal_says_why(cls: type, shapes: list, why: str,
                                        code: str | None) -> None:
    torch.manual_seed(0)
    inputs = [torch.randn(s) for s in shapes]
    with torch.no_grad():
        cls()(*inputs)                    # torch runs it
    for fused in (lambda: from_model(cls()), lambda: fused_class(cls)()):
        with pytest.raises(TailError) as ei:
            with torch.no_grad():
                fused()(*inputs)
        msg = str(ei.value)
        assert msg.startswith(cls.__name__), msg
        assert why in msg, msg
        if code is not None:
            assert f"{THIS}:{_line_of(cls, code)}" in msg, msg


# --- tail functions of fused_linear --------------------------------------------------------
def tail_with_linear(h):
    return F.linear(h, torch.ones(3, 6))


def tail_scaled(h, s):
    return h * s


_closed_bn = nn.BatchNorm1d(6).eval()


def tail_calls_module(h):
    return _closed_bn(h)


TAILS = [
    # (tail function, extra inputs, reason fragment)
    (tail_calls_module, (), "calls an nn.Module that is not a submodule"),
    (tail_with_linear, (), "a tail function may not contain another Linear"),
    (tail_scaled, (torch.tensor(2.0),), "input 1 is a 0-d tensor; inputs must have a batch "
     "dimension"),
]


@pytest.mark.parametrize("tail,extra,why", TAILS, ids=[t[0].__name__ for t in TAILS])
def test_tail_function_refusal_says_why(tail: Any, extra: tuple, why: str) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    tail(x @ w.t(), *extra)               # torch runs it
    with pytest.raises(TailError) as ei:
        fused_linear(x, w, None, tail, *extra)
    assert str(ei.value).startswith(f"{tail.__name__}: {why}"), str(ei.value)


@pytest.mark.parametrize("cls", [ReshapeComputedSize, LayerNormComputedShape])
def test_sizes_computed_from_feature_sizes_fuse(cls: type) -> None:
    """Feature sizes and arithmetic on them fold to numbers of the forward (not a program
    value id read as the size), so these fuse, with torch's result."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    model = cls()
    twin = fused_class(cls)()
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(from_model(model)(x), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(twin(x), want, atol=1e-5, rtol=1e-5)


# --- tail lambdas whose source is no statement of its own ---------------------------------
def _ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().t() + b.double()


def test_tail_lambda_on_a_continuation_line() -> None:
    """A lambda on a continuation line of a call (inspect.getsource gives
    ``lambda h: ...)``, which does not parse alone) is traced, and a refusal in it quotes
    its line; a lambda sharing a line with an augmented assignment of the caller's is not
    refused as if the lambda made it (lambdas hold no assignment: not checked)."""
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    out = fused_linear(x, w, b,
                       lambda h: torch.relu(h) * 2)
    torch.testing.assert_close(out.double(), torch.relu(_ref(x, w, b)) * 2, atol=1e-4, rtol=1e-4)
    out = fused_linear(x, w, b, lambda h: (torch.relu(h)
                                           * 3))
    torch.testing.assert_close(out.double(), torch.relu(_ref(x, w, b)) * 3, atol=1e-4, rtol=1e-4)
    n = 3
    k = n; k += 1; out = fused_linear(x, w, b, lambda h: h * k)  # noqa: E702
    torch.testing.assert_close(out.double(), _ref(x, w, b) * 4, atol=1e-4, rtol=1e-4)
    with pytest.raises(TailError) as ei:
        fused_linear(x, w, b,
                     lambda h: torch.cumprod(h, 1))
    lines, start = inspect.getsourcelines(test_tail_lambda_on_a_continuation_line)
    line = start + next(i for i, ln in enumerate(lines) if "torch.cumprod(h, 1))" in ln)
    msg = str(ei.value)
    assert msg.startswith("<lambda>: cannot fuse `torch.cumprod`"), msg
    assert msg.endswith(f"{THIS}:{line} in <lambda>: lambda h: torch.cumprod(h, 1))"), msg


def test_refusal_in_a_tail_without_source_names_its_line() -> None:
    """A tail from a string (exec, <stdin>: no source lines in its frames) names its own
    line, not the next frame's `File "...torch/fx/proxy.py", line ...` as its code."""
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    ns: dict = {"torch": torch}
    exec(compile("tail = (\n    lambda h: torch.cumprod(h, 1))\n", "<made>", "exec"), ns)
    with pytest.raises(TailError) as ei:
        fused_linear(x, w, None, ns["tail"])
    assert str(ei.value).endswith("\n  at <made>:2 in <lambda>"), str(ei.value)


# --- a float number input where torch takes an int -----------------------------------------
class FloatAsInt(_Base):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form

    def forward(self, x, a):
        h = self.fc(x)
        if self.form == "max_pool1d":
            return F.max_pool1d(h, a)
        if self.form == "avg_pool1d":
            return F.avg_pool1d(h.unsqueeze(1), a).squeeze(1)
        if self.form == "stride":
            return F.max_pool1d(h, 2, stride=a)
        if self.form == "adaptive_avg_pool1d":
            return F.adaptive_avg_pool1d(h, a)
        if self.form == "chunk":
            return h.chunk(a, -1)[0]
        if self.form == "split":
            return torch.split(h, a, -1)[0]
        if self.form == "split_sections":
            return h.split([a, 4], -1)[0]
        return h.sum(-1, keepdim=True).squeeze(a)


FLOAT_AS_INT = [   # (form, number, op, reason, code)
    ("max_pool1d", 2.5, "max_pool1d", "kernel_size 2.5 is not an int", "F.max_pool1d(h, a)"),
    ("avg_pool1d", 2.0, "avg_pool1d", "kernel_size 2.0 is not an int",
     "F.avg_pool1d(h.unsqueeze(1), a)"),
    ("stride", 1.0, "max_pool1d", "stride 1.0 is not an int", "stride=a"),
    ("adaptive_avg_pool1d", 3.0, "adaptive_avg_pool1d", "output_size 3.0 is not an int",
     "F.adaptive_avg_pool1d(h, a)"),
    ("chunk", 2.0, "chunk", "chunks 2.0 is not an int", "h.chunk(a, -1)"),
    ("split", 2.0, "split", "split_size 2.0 is not an int", "torch.split(h, a, -1)"),
    ("split_sections", 2.0, "split", "a split size 2.0 is not an int", "h.split([a, 4], -1)"),
    ("squeeze", -1.0, "squeeze", "a dim that is not an int (-1.0)", ".squeeze(a)"),
]


@pytest.mark.parametrize("form,a,op,why,code", FLOAT_AS_INT, ids=[c[0] for c in FLOAT_AS_INT])
def test_float_number_where_torch_takes_an_int_is_refused(form, a, op, why, code) -> None:
    """fm(x, 2.0) where the number is a pool's kernel, a chunk count, a split size or a
    squeeze dim: torch raises TypeError; cupyfuse refuses it, naming the op and the line
    (neither truncating it, for pools and chunk, nor failing inside the translator with
    "'float' object is not iterable", for split and squeeze); the int still fuses."""
    torch.manual_seed(0)
    m = FloatAsInt(form)
    x = torch.randn(4, 8)
    with pytest.raises(TypeError):
        m(x, a)
    for fm in (from_model(m), fused_class(FloatAsInt)(form)):
        with pytest.raises(TailError) as ei, torch.no_grad():
            fm(x, a)
        msg = str(ei.value)
        assert msg.startswith("FloatAsInt: ") and f"`{op}" in msg.replace("`.", "`"), msg
        assert why in msg, msg
        assert f"{THIS}:{_line_of(FloatAsInt, code)} in forward" in msg, msg
    fm = from_model(m)
    with torch.no_grad():
        torch.testing.assert_close(fm(x, int(a)), m(x, int(a)), atol=1e-5, rtol=1e-5)


class _MaxPoolStride0(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        return F.max_pool1d(self.fc(x).unsqueeze(1), 2, 0).squeeze(1)


def test_pool_stride_zero_is_refused_like_torch_raises():
    m = _MaxPoolStride0()
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError):
        m(x)
    with warnings.catch_warnings(), pytest.raises(TailError, match="greater than zero"):
        warnings.simplefilter("ignore")
        from_model(m)(x)


# --- ops of a boolean tensor that torch raises on (abs, relu, activations, norms...) ------
class BoolOperandOp(nn.Module):
    """An op of the mask ``h > 0`` (the forward's own, or a bool input's ``mask``)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.form = form
        self.act = nn.GELU()
        self.ln = nn.LayerNorm(6)

    def forward(self, x, mask):
        h = self.fc(x)
        m = h > 0
        if self.form == "abs_method":
            return h * m.abs()
        if self.form == "torch_abs":
            return h * torch.abs(m)
        if self.form == "builtin_abs":
            return h * abs(m)
        if self.form == "abs_input":
            return h * mask.abs()
        if self.form == "relu":
            return h * torch.relu(m)
        if self.form == "silu":
            return h * F.silu(m)
        if self.form == "gelu_fn":
            return h * F.gelu(m)
        if self.form == "softshrink":
            return h * F.softshrink(m)
        if self.form == "selu":
            return h * F.selu(m)
        if self.form == "softmax":
            return h * m.softmax(-1)
        if self.form == "layer_norm":
            return h * F.layer_norm(m, (6,))
        if self.form == "gelu_module":
            return h * self.act(m)
        if self.form == "ln_module":
            return h * self.ln(mask)
        return h * m.square()


BOOL_OPERAND = [   # (form, op, reason, code)
    ("abs_method", "abs", "abs of a boolean tensor (torch raises)", "m.abs()"),
    ("torch_abs", "abs", "abs of a boolean tensor (torch raises)", "torch.abs(m)"),
    ("builtin_abs", "abs", "abs of a boolean tensor (torch raises)", "h * abs(m)"),
    ("abs_input", "abs", "abs of a boolean tensor (torch raises)", "mask.abs()"),
    ("relu", "relu", "relu of a boolean tensor (torch raises)", "torch.relu(m)"),
    ("silu", "silu", "silu of a boolean tensor (torch raises)", "F.silu(m)"),
    ("gelu_fn", "gelu", "a boolean tensor operand (torch raises)", "F.gelu(m)"),
    ("softshrink", "softshrink", "a boolean tensor operand (torch raises)", "F.softshrink(m)"),
    ("selu", "selu", "a boolean tensor operand (torch raises)", "F.selu(m)"),
    ("softmax", "softmax", "a boolean tensor operand (torch raises)", "m.softmax(-1)"),
    ("layer_norm", "layer_norm", "a boolean tensor operand (torch raises)",
     "F.layer_norm(m, (6,))"),
    ("gelu_module", "act (GELU)", "a boolean tensor operand (torch raises)", "self.act(m)"),
    ("ln_module", "ln (LayerNorm)", "a boolean tensor operand (torch raises)", "self.ln(mask)"),
]


@pytest.mark.parametrize("form,op,why,code", BOOL_OPERAND, ids=[c[0] for c in BOOL_OPERAND])
def test_op_torch_raises_on_for_a_boolean_tensor_is_refused(form, op, why, code) -> None:
    """abs/relu/silu/gelu/softmax/LayerNorm... of a boolean tensor: torch raises
    (NotImplementedError or RuntimeError); cupyfuse refuses them, naming the op and the
    line, rather than computing them on the mask read as 0.0 / 1.0 (`(h > 0).abs()`)."""
    torch.manual_seed(0)
    m = BoolOperandOp(form)
    x, mask = torch.randn(4, 8), torch.randn(4, 6) > 0
    with pytest.raises((RuntimeError, NotImplementedError)), torch.no_grad():
        m(x, mask)
    for fm in (from_model(m), fused_class(BoolOperandOp)(form)):
        with pytest.raises(TailError) as ei, torch.no_grad():
            fm(x, mask)
        msg = str(ei.value)
        assert msg.startswith("BoolOperandOp: ") and f"`{op}" in msg.replace("`.", "`"), msg
        assert why in msg, msg
        assert f"{THIS}:{_line_of(BoolOperandOp, code)} in forward" in msg, msg


def test_square_of_a_boolean_tensor_is_refused_torch_gives_int64() -> None:
    """torch squares a boolean tensor into int64 (a dtype cupyfuse does not give): refused
    with that reason, not computed as float32."""
    m = BoolOperandOp("square")
    x, mask = torch.randn(4, 8), torch.randn(4, 6) > 0
    assert ((torch.randn(3) > 0).square()).dtype == torch.int64
    with pytest.raises(TailError) as ei, torch.no_grad():
        from_model(m)(x, mask)
    msg = str(ei.value)
    assert "square of a boolean tensor (torch gives int64 there)" in msg, msg
    assert f"{THIS}:{_line_of(BoolOperandOp, 'm.square()')} in forward" in msg, msg


class BoolFloatOps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x, mask):
        h = self.fc(x)
        m = h > 0
        return h * m.sigmoid() + torch.exp(m) - mask.sqrt() * torch.erf(mask) + m.log1p()


def test_ops_torch_computes_on_a_boolean_tensor_still_fuse() -> None:
    """The unary ops torch promotes a boolean tensor to float for (sigmoid, exp, sqrt, erf,
    log1p...) still fuse, against a float64 reference."""
    torch.manual_seed(0)
    m = BoolFloatOps()
    x, mask = torch.randn(5, 8), torch.randn(5, 6) > 0
    with torch.no_grad():
        ref = copy.deepcopy(m).double()(x.double(), mask)
        got = from_model(m)(x, mask)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)


class _TensorOfSize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x) * torch.tensor(x.shape[0])


def test_tensor_of_a_traced_size_names_the_form() -> None:
    """torch.fx's own text for `torch.tensor(x.shape[0])` ("`__cuda_array_interface__`
    must be a dict") names nothing the user wrote: the refusal says which form fails, what
    to write instead, and quotes the forward's line."""
    with pytest.raises(Exception) as ei:
        from_model(_TensorOfSize())(torch.randn(2, 3))
    msg = str(ei.value)
    assert "could not trace" in msg and "torch.tensor(x.shape[0])" in msg
    assert "h * x.shape[0]" in msg
    assert "return self.fc(x) * torch.tensor(x.shape[0])" in msg


def test_assignment_to_module_state_is_refused_and_the_model_left_whole() -> None:
    """``self.count += 1`` in a forward: fx would run the assignment on the module itself
    (a Proxy left in the user's model); a buffer replaced is refused naming it, the model
    intact; a plain attribute set and read in the forward fuses, and is not left behind."""
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.register_buffer("count", torch.zeros(()))
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.count += 1
            return self.fc(x).relu()

    m = Counting()
    with pytest.raises(TailError, match="assignment to the module's `count`"):
        from_model(m)
    assert type(m.count) is torch.Tensor and float(m.count) == 0.0
    assert list(m.state_dict()) == ["count", "fc.weight", "fc.bias"]

    class Attr(Counting):   # a plain attribute the forward sets and reads: fused
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.last = x
            return self.fc(self.last)

    a = Attr()
    fused = from_model(a)
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.allclose(fused(x), a.fc(x), atol=1e-6)
    assert "last" not in a.__dict__ or not isinstance(a.__dict__["last"], torch.fx.Proxy)
