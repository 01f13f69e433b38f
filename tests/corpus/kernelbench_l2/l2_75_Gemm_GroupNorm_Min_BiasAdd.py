"""KernelBench level 2, problem 75 (Gemm_GroupNorm_Min_BiasAdd), rewritten."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192
num_groups = 512
bias_shape = (1, out_features, 1, 1)


class Model(nn.Module):
    """Row min of group_norm(gemm(x)), (batch, 1), plus a (1, out, 1, 1) bias, broadcasting to (1, out, batch, 1): (batch, in) -> (1, out, batch, 1)."""

    def __init__(self, in_features, out_features, num_groups, bias_shape):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.group_norm = nn.GroupNorm(num_groups, out_features)
        self.bias = nn.Parameter(torch.randn(bias_shape))

    def forward(self, x):
        h = self.gemm(x)
        h = self.group_norm(h)
        h = torch.min(h, dim=1, keepdim=True)[0]
        return h + self.bias


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, num_groups, bias_shape]
