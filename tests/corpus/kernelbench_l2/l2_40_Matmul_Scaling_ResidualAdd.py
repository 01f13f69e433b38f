"""KernelBench level 2, problem 40 (Matmul_Scaling_ResidualAdd), rewritten."""
import torch
import torch.nn as nn

batch_size = 16384
in_features = 4096
out_features = 4096
scaling_factor = 0.5


class Model(nn.Module):
    """h * scaling_factor + detached copy of h, h = matmul(x): (batch, in) -> (batch, out)."""

    def __init__(self, in_features, out_features, scaling_factor):
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.scaling_factor = scaling_factor

    def forward(self, x):
        h = self.matmul(x)
        residual = h.clone().detach()
        h = h * self.scaling_factor
        return h + residual


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, scaling_factor]
