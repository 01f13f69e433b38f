"""KernelBench level 2, problem 55 (Matmul_MaxPool_Sum_Scale), rewritten."""
import torch
import torch.nn as nn

batch_size = 128
in_features = 32768
out_features = 32768
kernel_size = 2
scale_factor = 0.5


class Model(nn.Module):
    """Row sum of MaxPool1d(kernel_size) over the features of matmul(x), times scale_factor: (batch, in) -> (batch,)."""

    def __init__(self, in_features, out_features, kernel_size, scale_factor):
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.max_pool = nn.MaxPool1d(kernel_size)
        self.scale_factor = scale_factor

    def forward(self, x):
        h = self.matmul(x)
        h = self.max_pool(h.unsqueeze(1)).squeeze(1)
        h = torch.sum(h, dim=1)
        return h * self.scale_factor


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, kernel_size, scale_factor]
