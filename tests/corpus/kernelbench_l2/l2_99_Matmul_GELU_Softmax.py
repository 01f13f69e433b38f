"""KernelBench level 2, problem 99 (Matmul_GELU_Softmax), rewritten."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192


class Model(nn.Module):
    """Row softmax of gelu(linear(x)): (batch, in) -> (batch, out)."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        h = self.linear(x)
        h = torch.nn.functional.gelu(h)
        return torch.nn.functional.softmax(h, dim=1)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
