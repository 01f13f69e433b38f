"""KernelBench level 2, problem 39 (Gemm_Scale_BatchNorm), rewritten."""
import torch
import torch.nn as nn

batch_size = 16384
in_features = 4096
out_features = 4096
scale_shape = (out_features,)


class Model(nn.Module):
    """BatchNorm1d(gemm(x) * scale), scale a randn (out,) parameter: (batch, in) -> (batch, out)."""

    def __init__(self, in_features, out_features, scale_shape, eps=1e-5, momentum=0.1):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.scale = nn.Parameter(torch.randn(scale_shape))
        self.bn = nn.BatchNorm1d(out_features, eps=eps, momentum=momentum)

    def forward(self, x):
        h = self.gemm(x)
        h = h * self.scale
        return self.bn(h)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, scale_shape]
