"""KernelBench level 2, problem 56 (Matmul_Sigmoid_Sum), rewritten."""
import torch
import torch.nn as nn

batch_size = 128
input_size = 32768
hidden_size = 32768


class Model(nn.Module):
    """Row sum of sigmoid(linear(x)): (batch, input) -> (batch, 1)."""

    def __init__(self, input_size, hidden_size):
        super().__init__()
        self.linear = nn.Linear(input_size, hidden_size)

    def forward(self, x):
        h = self.linear(x)
        h = torch.sigmoid(h)
        return torch.sum(h, dim=1, keepdim=True)


def get_inputs():
    return [torch.rand(batch_size, input_size)]


def get_init_inputs():
    return [input_size, hidden_size]
