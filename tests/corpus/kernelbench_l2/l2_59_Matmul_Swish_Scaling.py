"""KernelBench level 2, problem 59 (Matmul_Swish_Scaling), rewritten."""
import torch
import torch.nn as nn

batch_size = 128
in_features = 32768
out_features = 32768
scaling_factor = 2.0


class Model(nn.Module):
    """swish(matmul(x)) * scaling_factor: (batch, in) -> (batch, out)."""

    def __init__(self, in_features, out_features, scaling_factor):
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.scaling_factor = scaling_factor

    def forward(self, x):
        h = self.matmul(x)
        h = h * torch.sigmoid(h)
        return h * self.scaling_factor


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, scaling_factor]
