"""KernelBench level 2, problem 30 (Gemm_GroupNorm_Hardtanh), rewritten."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192
num_groups = 16
hardtanh_min = -2.0
hardtanh_max = 2.0


class Model(nn.Module):
    """hardtanh(group_norm(gemm(x)), hardtanh_min, hardtanh_max): (batch, in) -> (batch, out)."""

    def __init__(self, in_features, out_features, num_groups, hardtanh_min, hardtanh_max):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.group_norm = nn.GroupNorm(num_groups, out_features)
        self.hardtanh = nn.Hardtanh(min_val=hardtanh_min, max_val=hardtanh_max)

    def forward(self, x):
        h = self.gemm(x)
        h = self.group_norm(h)
        return self.hardtanh(h)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, num_groups, hardtanh_min, hardtanh_max]
