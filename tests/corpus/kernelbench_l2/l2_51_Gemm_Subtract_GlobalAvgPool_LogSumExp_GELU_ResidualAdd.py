"""KernelBench level 2, problem 51 (Gemm_Subtract_GlobalAvgPool_LogSumExp_GELU_ResidualAdd), rewritten."""
import torch
import torch.nn as nn

batch_size = 2048
in_features = 8192
out_features = 8192


class Model(nn.Module):
    """gelu(logsumexp(row mean(gemm(x) - subtract))) broadcast-added to a detached copy of the input x: (batch, in) -> (batch, in)."""

    def __init__(self, in_features, out_features, bias=True):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features, bias=bias)
        self.subtract = nn.Parameter(torch.randn(out_features))

    def forward(self, x):
        residual = x.clone().detach()
        h = self.gemm(x)
        h = h - self.subtract
        h = torch.mean(h, dim=1, keepdim=True)
        h = torch.logsumexp(h, dim=1, keepdim=True)
        h = torch.nn.functional.gelu(h)
        return h + residual


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
