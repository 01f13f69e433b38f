"""KernelBench level 2, problem 37 (Matmul_Swish_Sum_GroupNorm), rewritten."""
import torch
import torch.nn as nn

batch_size = 32768
in_features = 1024
out_features = 4096
num_groups = 64
bias_shape = (out_features,)


class Model(nn.Module):
    """group_norm(swish(matmul(x)) + bias), bias a randn (out,) parameter: (batch, in) -> (batch, out)."""

    def __init__(self, in_features, out_features, num_groups, bias_shape):
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.bias = nn.Parameter(torch.randn(bias_shape))
        self.group_norm = nn.GroupNorm(num_groups, out_features)

    def forward(self, x):
        h = self.matmul(x)
        h = torch.sigmoid(h) * h
        h = h + self.bias
        return self.group_norm(h)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, num_groups, bias_shape]
