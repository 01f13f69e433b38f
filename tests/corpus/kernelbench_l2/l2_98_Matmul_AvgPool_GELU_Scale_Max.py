"""KernelBench level 2, problem 98 (Matmul_AvgPool_GELU_Scale_Max), rewritten."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192
pool_kernel_size = 16
scale_factor = 2.0


class Model(nn.Module):
    """Row max of gelu(AvgPool1d(pool_kernel_size) over the features of matmul(x)) * scale_factor: (batch, in) -> (batch,)."""

    def __init__(self, in_features, out_features, pool_kernel_size, scale_factor):
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.avg_pool = nn.AvgPool1d(kernel_size=pool_kernel_size)
        self.scale_factor = scale_factor

    def forward(self, x):
        h = self.matmul(x)
        h = self.avg_pool(h.unsqueeze(1)).squeeze(1)
        h = torch.nn.functional.gelu(h)
        h = h * self.scale_factor
        return torch.max(h, dim=1).values


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, pool_kernel_size, scale_factor]
