"""KernelBench level 2, problem 9 (Matmul_Subtract_Multiply_ReLU), rewritten."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192
subtract_value = 2.0
multiply_value = 1.5


class Model(nn.Module):
    """relu((linear(x) - subtract_value) * multiply_value): (batch, in) -> (batch, out)."""

    def __init__(self, in_features, out_features, subtract_value, multiply_value):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.subtract_value = subtract_value
        self.multiply_value = multiply_value

    def forward(self, x):
        h = self.linear(x)
        h = h - self.subtract_value
        h = h * self.multiply_value
        return torch.relu(h)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, subtract_value, multiply_value]
