"""KernelBench level 2, problem 62 (Matmul_GroupNorm_LeakyReLU_Sum), rewritten."""
import torch
import torch.nn as nn

batch_size = 1024
input_size = 8192
hidden_size = 8192
num_groups = 512


class Model(nn.Module):
    """2 * leaky_relu(group_norm(fc(x))), doubling done as h + h: (batch, input) -> (batch, hidden)."""

    def __init__(self, input_size, hidden_size, num_groups, eps=1e-5, negative_slope=0.01):
        super().__init__()
        self.fc = nn.Linear(input_size, hidden_size)
        self.gn = nn.GroupNorm(num_groups=num_groups, num_channels=hidden_size, eps=eps)
        self.leaky_relu = nn.LeakyReLU(negative_slope=negative_slope)

    def forward(self, x):
        h = self.fc(x)
        h = self.gn(h)
        h = self.leaky_relu(h)
        return h + h


def get_inputs():
    return [torch.rand(batch_size, input_size)]


def get_init_inputs():
    return [input_size, hidden_size, num_groups]
