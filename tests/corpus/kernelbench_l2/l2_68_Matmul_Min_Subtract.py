"""KernelBench level 2, problem 68 (Matmul_Min_Subtract), rewritten."""
import torch
import torch.nn as nn

batch_size = 128
in_features = 16384
out_features = 16384
constant = 2.0


class Model(nn.Module):
    """minimum(linear(x), c) - c, c a 0-dim parameter initialised to constant: (batch, in) -> (batch, out)."""

    def __init__(self, in_features, out_features, constant):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.constant = nn.Parameter(torch.tensor(constant))

    def forward(self, x):
        h = self.linear(x)
        h = torch.min(h, self.constant)
        return h - self.constant


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, constant]
