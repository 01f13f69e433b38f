"""KernelBench level 2, problem 41 (Gemm_BatchNorm_GELU_ReLU), rewritten."""
import torch
import torch.nn as nn

batch_size = 16384
in_features = 4096
out_features = 4096


class Model(nn.Module):
    """relu(gelu(BatchNorm1d(gemm(x)))): (batch, in) -> (batch, out)."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.batch_norm = nn.BatchNorm1d(out_features)

    def forward(self, x):
        h = self.gemm(x)
        h = self.batch_norm(h)
        h = torch.nn.functional.gelu(h)
        return torch.relu(h)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
