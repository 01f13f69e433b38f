"""KernelBench level 2, problem 63 (Gemm_ReLU_Divide), rewritten."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192
divisor = 2.0


class Model(nn.Module):
    """relu(linear(x)) / divisor: (batch, in) -> (batch, out)."""

    def __init__(self, in_features, out_features, divisor):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.divisor = divisor

    def forward(self, x):
        h = self.linear(x)
        h = torch.relu(h)
        return h / self.divisor


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, divisor]
