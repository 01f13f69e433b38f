"""KernelBench level 2, problem 97 (Matmul_BatchNorm_BiasAdd_Divide_Swish), rewritten."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192
bn_eps = 1e-5
bn_momentum = 0.1
bias_shape = (1,)
divide_value = 1.0


class Model(nn.Module):
    """swish((BatchNorm1d(matmul(x)) + bias) / divide_value), bias a randn (1,) parameter: (batch, in) -> (batch, out)."""

    def __init__(self, in_features, out_features, bn_eps=1e-5, bn_momentum=0.1, bias_shape=(1,), divide_value=1.0):
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.bn = nn.BatchNorm1d(out_features, eps=bn_eps, momentum=bn_momentum)
        self.bias = nn.Parameter(torch.randn(bias_shape))
        self.divide_value = divide_value

    def forward(self, x):
        h = self.matmul(x)
        h = self.bn(h)
        h = h + self.bias
        h = h / self.divide_value
        return h * torch.sigmoid(h)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, bn_eps, bn_momentum, bias_shape, divide_value]
