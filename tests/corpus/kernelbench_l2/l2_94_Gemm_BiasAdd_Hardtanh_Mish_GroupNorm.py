"""KernelBench level 2, problem 94 (Gemm_BiasAdd_Hardtanh_Mish_GroupNorm), rewritten."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192
bias_shape = (out_features,)
num_groups = 256


class Model(nn.Module):
    """group_norm(mish(hardtanh(gemm(x) + bias))), hardtanh on [-1, 1], bias a randn (out,) parameter: (batch, in) -> (batch, out)."""

    def __init__(self, in_features, out_features, bias_shape, num_groups):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.bias = nn.Parameter(torch.randn(bias_shape))
        self.hardtanh = nn.Hardtanh()
        self.mish = nn.Mish()
        self.groupnorm = nn.GroupNorm(num_groups=num_groups, num_channels=out_features)

    def forward(self, x):
        h = self.gemm(x)
        h = h + self.bias
        h = self.hardtanh(h)
        h = self.mish(h)
        return self.groupnorm(h)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, bias_shape, num_groups]
