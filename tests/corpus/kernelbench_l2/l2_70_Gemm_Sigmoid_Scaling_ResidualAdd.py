"""KernelBench level 2, problem 70 (Gemm_Sigmoid_Scaling_ResidualAdd), rewritten."""
import torch
import torch.nn as nn

batch_size = 1024
input_size = 8192
hidden_size = 8192
scaling_factor = 2.0


class Model(nn.Module):
    """sigmoid(h) * scaling_factor + h, h = gemm(x) (not detached): (batch, input) -> (batch, hidden)."""

    def __init__(self, input_size, hidden_size, scaling_factor):
        super().__init__()
        self.gemm = nn.Linear(input_size, hidden_size)
        self.scaling_factor = scaling_factor

    def forward(self, x):
        h = self.gemm(x)
        residual = h
        h = torch.sigmoid(h)
        h = h * self.scaling_factor
        return h + residual


def get_inputs():
    return [torch.rand(batch_size, input_size)]


def get_init_inputs():
    return [input_size, hidden_size, scaling_factor]
