"""KernelBench level 2, problem 53 (Gemm_Scaling_Hardtanh_GELU), rewritten."""
import torch
import torch.nn as nn

batch_size = 2048
in_features = 8192
out_features = 8192
scaling_factor = 0.5
hardtanh_min = -2
hardtanh_max = 2


class Model(nn.Module):
    """gelu(hardtanh(gemm(x) * scaling_factor, hardtanh_min, hardtanh_max)): (batch, in) -> (batch, out)."""

    def __init__(self, in_features, out_features, scaling_factor, hardtanh_min, hardtanh_max):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.scaling_factor = scaling_factor
        self.hardtanh = nn.Hardtanh(min_val=hardtanh_min, max_val=hardtanh_max)
        self.gelu = nn.GELU()

    def forward(self, x):
        h = self.gemm(x)
        h = h * self.scaling_factor
        h = self.hardtanh(h)
        return self.gelu(h)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, scaling_factor, hardtanh_min, hardtanh_max]
