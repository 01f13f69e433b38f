"""KernelBench level 2, problem 64 (Gemm_LogSumExp_LeakyReLU_LeakyReLU_GELU_GELU), rewritten."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192


class Model(nn.Module):
    """gelu(gelu(leaky_relu(leaky_relu(row logsumexp(linear(x)))))), slopes 0.01: (batch, in) -> (batch, 1)."""

    def __init__(self, in_features, out_features, bias=True):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias)

    def forward(self, x):
        F = torch.nn.functional
        h = self.linear(x)
        h = torch.logsumexp(h, dim=1, keepdim=True)
        h = F.leaky_relu(h, negative_slope=0.01)
        h = F.leaky_relu(h, negative_slope=0.01)
        h = F.gelu(h)
        return F.gelu(h)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
