"""KernelBench level 2, problem 29 (Matmul_Mish_Mish), rewritten."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192


class Model(nn.Module):
    """mish(mish(linear(x))): (batch, in) -> (batch, out)."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        h = self.linear(x)
        h = torch.nn.functional.mish(h)
        return torch.nn.functional.mish(h)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
