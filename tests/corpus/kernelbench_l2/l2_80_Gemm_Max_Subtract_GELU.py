"""KernelBench level 2, problem 80 (Gemm_Max_Subtract_GELU), rewritten."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192
max_dim = 1


class Model(nn.Module):
    """m = max of gemm(x) over max_dim (keepdim), gelu(m - mean of m over dim 1); with max_dim=1 that mean is over size 1: (batch, in) -> (batch, 1)."""

    def __init__(self, in_features, out_features, max_dim):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.max_dim = max_dim

    def forward(self, x):
        h = self.gemm(x)
        h = torch.max(h, dim=self.max_dim, keepdim=True).values
        h = h - h.mean(dim=1, keepdim=True)
        return torch.nn.functional.gelu(h)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, max_dim]
