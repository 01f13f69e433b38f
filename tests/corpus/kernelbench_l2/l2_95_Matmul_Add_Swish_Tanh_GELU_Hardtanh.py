"""KernelBench level 2, problem 95 (Matmul_Add_Swish_Tanh_GELU_Hardtanh), rewritten."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192
add_value_shape = (out_features,)


class Model(nn.Module):
    """hardtanh(gelu(tanh(swish(matmul(x) + add_value))), -1, 1), add_value a randn (out,) parameter: (batch, in) -> (batch, out)."""

    def __init__(self, in_features, out_features, add_value_shape):
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.add_value = nn.Parameter(torch.randn(add_value_shape))

    def forward(self, x):
        h = self.matmul(x)
        h = h + self.add_value
        h = torch.sigmoid(h) * h
        h = torch.tanh(h)
        h = torch.nn.functional.gelu(h)
        return torch.nn.functional.hardtanh(h, min_val=-1, max_val=1)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, add_value_shape]
