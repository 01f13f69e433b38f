"""The four original models (KernelBench level 2: 55, 56, 98, 39), written from PROBLEMS.md.

These are the references the fused versions are checked against. Each problem has a
``SIZES`` entry per size name (``"kernelbench"``, ``"seed"`` for 39 only, ``"small"`` for
CPU tests) and ``get_inputs``/``get_init_inputs`` helpers in KernelBench's style.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "MatmulMaxPoolSumScale", "MatmulSigmoidSum", "MatmulAvgPoolGeluScaleMax", "GemmScaleBatchNorm",
    "PROBLEMS", "Problem", "get_inputs", "get_init_inputs", "make_model",
]


class MatmulMaxPoolSumScale(nn.Module):
    """55: Linear -> MaxPool1d(kernel_size) -> sum(dim=1) -> * scale_factor. (B, in) -> (B,)."""

    def __init__(self, in_features: int, out_features: int, kernel_size: int, scale_factor: float):
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.max_pool = nn.MaxPool1d(kernel_size)
        self.scale_factor = scale_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.matmul(x)
        x = self.max_pool(x.unsqueeze(1)).squeeze(1)
        x = torch.sum(x, dim=1)
        x = x * self.scale_factor
        return x


class MatmulSigmoidSum(nn.Module):
    """56: Linear -> sigmoid -> sum(dim=1, keepdim=True). (B, in) -> (B, 1)."""

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(input_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        x = torch.sigmoid(x)
        x = torch.sum(x, dim=1, keepdim=True)
        return x


class MatmulAvgPoolGeluScaleMax(nn.Module):
    """98: Linear -> AvgPool1d(k) -> GELU (erf) -> * scale_factor -> max(dim=1). (B, in) -> (B,)."""

    def __init__(self, in_features: int, out_features: int, pool_kernel_size: int,
                 scale_factor: float):
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.avg_pool = nn.AvgPool1d(kernel_size=pool_kernel_size)
        self.scale_factor = scale_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.matmul(x)
        x = self.avg_pool(x.unsqueeze(1)).squeeze(1)
        x = F.gelu(x)
        x = x * self.scale_factor
        x = torch.max(x, dim=1).values
        return x


class GemmScaleBatchNorm(nn.Module):
    """39: Linear -> * scale (per column) -> BatchNorm1d. (B, in) -> (B, out)."""

    def __init__(self, in_features: int, out_features: int, scale_shape: Any, eps: float = 1e-5,
                 momentum: float = 0.1):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.scale = nn.Parameter(torch.randn(scale_shape))
        self.bn = nn.BatchNorm1d(out_features, eps=eps, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gemm(x)
        x = x * self.scale
        x = self.bn(x)
        return x


@dataclass(frozen=True)
class Problem:
    key: str           # "55", "56", "98", "39"
    name: str
    model: type
    sizes: dict        # size name -> (batch, init args tuple)


PROBLEMS: dict[str, Problem] = {
    "55": Problem("55", "Matmul_MaxPool_Sum_Scale", MatmulMaxPoolSumScale, {
        "kernelbench": (128, (32768, 32768, 2, 0.5)),
        "small": (37, (300, 258, 2, 0.5)),
    }),
    "56": Problem("56", "Matmul_Sigmoid_Sum", MatmulSigmoidSum, {
        "kernelbench": (128, (32768, 32768)),
        "small": (37, (300, 259)),
    }),
    "98": Problem("98", "Matmul_AvgPool_GELU_Scale_Max", MatmulAvgPoolGeluScaleMax, {
        "kernelbench": (1024, (8192, 8192, 16, 2.0)),
        "small": (37, (300, 264, 16, 2.0)),
    }),
    "39": Problem("39", "Gemm_Scale_BatchNorm", GemmScaleBatchNorm, {
        "kernelbench": (16384, (4096, 4096, (4096,))),
        "seed": (1024, (8192, 8192, (8192,))),
        "small": (37, (300, 259, (259,))),
    }),
}


def get_init_inputs(problem: str, size: str = "kernelbench") -> list:
    """Constructor arguments of ``problem`` at ``size`` (KernelBench's get_init_inputs)."""
    return list(PROBLEMS[problem].sizes[size][1])


def get_inputs(problem: str, size: str = "kernelbench", device: Any = "cpu",
               generator: torch.Generator | None = None) -> list:
    """``[torch.rand(batch, in_features)]`` as in the benchmark protocol."""
    batch, init = PROBLEMS[problem].sizes[size]
    return [torch.rand(batch, init[0], device=device, generator=generator)]


def make_model(problem: str, size: str = "kernelbench", device: Any = "cpu") -> nn.Module:
    """The original model of ``problem`` at ``size`` (default init, current RNG state)."""
    with torch.device(device):
        return PROBLEMS[problem].model(*get_init_inputs(problem, size))
