"""KernelBench level 2, problem 88 (Gemm_GroupNorm_Swish_Multiply_Swish), rewritten."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192
num_groups = 256
multiply_weight_shape = (out_features,)


class Model(nn.Module):
    """swish(swish(group_norm(gemm(x))) * w), w a randn (out,) parameter: (batch, in) -> (batch, out)."""

    def __init__(self, in_features, out_features, num_groups, multiply_weight_shape):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.group_norm = nn.GroupNorm(num_groups, out_features)
        self.multiply_weight = nn.Parameter(torch.randn(multiply_weight_shape))

    def forward(self, x):
        h = self.gemm(x)
        h = self.group_norm(h)
        h = h * torch.sigmoid(h)
        h = h * self.multiply_weight
        return h * torch.sigmoid(h)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, num_groups, multiply_weight_shape]
