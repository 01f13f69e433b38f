"""KernelBench level 2, problem 66 (Matmul_Dropout_Softmax), rewritten."""
import torch
import torch.nn as nn

batch_size = 128
in_features = 16384
out_features = 16384
dropout_p = 0.2


class Model(nn.Module):
    """Row softmax of dropout(matmul(x), dropout_p), dropout active in train mode: (batch, in) -> (batch, out)."""

    def __init__(self, in_features, out_features, dropout_p):
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.dropout = nn.Dropout(dropout_p)

    def forward(self, x):
        h = self.matmul(x)
        h = self.dropout(h)
        return torch.softmax(h, dim=1)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, dropout_p]
