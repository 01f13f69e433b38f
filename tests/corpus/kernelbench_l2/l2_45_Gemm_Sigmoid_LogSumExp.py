"""KernelBench level 2, problem 45 (Gemm_Sigmoid_LogSumExp), rewritten."""
import torch
import torch.nn as nn

batch_size = 16384
input_size = 2048
hidden_size = 4096
output_size = 1024


class Model(nn.Module):
    """Row logsumexp of linear2(sigmoid(linear1(x))), two GEMMs: (batch, input) -> (batch,)."""

    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        self.linear1 = nn.Linear(input_size, hidden_size)
        self.linear2 = nn.Linear(hidden_size, output_size)

    def forward(self, x):
        h = self.linear1(x)
        h = torch.sigmoid(h)
        h = self.linear2(h)
        return torch.logsumexp(h, dim=1)


def get_inputs():
    return [torch.rand(batch_size, input_size)]


def get_init_inputs():
    return [input_size, hidden_size, output_size]
