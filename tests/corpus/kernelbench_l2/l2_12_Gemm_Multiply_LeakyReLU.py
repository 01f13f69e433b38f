"""KernelBench level 2, problem 12 (Gemm_Multiply_LeakyReLU), rewritten."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192
multiplier = 2.0
negative_slope = 0.1


class Model(nn.Module):
    """leaky_relu(gemm(x) * multiplier, negative_slope): (batch, in) -> (batch, out)."""

    def __init__(self, in_features, out_features, multiplier, negative_slope):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.multiplier = multiplier
        self.leaky_relu = nn.LeakyReLU(negative_slope)

    def forward(self, x):
        h = self.gemm(x)
        h = h * self.multiplier
        return self.leaky_relu(h)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, multiplier, negative_slope]
