"""KernelBench level 2, problem 14 (Gemm_Divide_Sum_Scaling), rewritten."""
import torch
import torch.nn as nn

batch_size = 1024
input_size = 8192
hidden_size = 8192
scaling_factor = 1.5


class Model(nn.Module):
    """Row sum of (x @ W.T) / 2, times scaling_factor, W a raw randn (hidden, input) weight, no bias: (batch, input) -> (batch, 1)."""

    def __init__(self, input_size, hidden_size, scaling_factor):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden_size, input_size))
        self.scaling_factor = scaling_factor

    def forward(self, x):
        h = torch.matmul(x, self.weight.T)
        h = h / 2
        h = torch.sum(h, dim=1, keepdim=True)
        return h * self.scaling_factor


def get_inputs():
    return [torch.rand(batch_size, input_size)]


def get_init_inputs():
    return [input_size, hidden_size, scaling_factor]
