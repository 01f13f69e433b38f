"""KernelBench level 2, problem 76 (Gemm_Add_ReLU), rewritten."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192
bias_shape = (out_features,)


class Model(nn.Module):
    """relu(x @ W.T + bias), Linear without bias plus a randn (out,) bias parameter: (batch, in) -> (batch, out)."""

    def __init__(self, in_features, out_features, bias_shape):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features, bias=False)
        self.bias = nn.Parameter(torch.randn(bias_shape))

    def forward(self, x):
        h = self.gemm(x)
        h = h + self.bias
        return torch.relu(h)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, bias_shape]
