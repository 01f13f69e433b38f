"""KernelBench level 2, problem 28 (BMM_InstanceNorm_Sum_ResidualAdd_Multiply), rewritten."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192


class Model(nn.Module):
    """(n + y) * y, n = InstanceNorm2d of bmm(x) viewed as (batch, 1, 1, out), i.e. each row normalized: (batch, in), (batch, out) -> (batch, out)."""

    def __init__(self, in_features, out_features, eps=1e-5, momentum=0.1):
        super().__init__()
        self.bmm = nn.Linear(in_features, out_features)
        self.instance_norm = nn.InstanceNorm2d(out_features, eps=eps, momentum=momentum)

    def forward(self, x, y):
        h = self.bmm(x)
        # One channel of spatial size 1 x out: num_features (out) does not match the
        # channel count (1); without affine/running stats PyTorch only warns.
        h = self.instance_norm(h.unsqueeze(1).unsqueeze(1)).squeeze(1).squeeze(1)
        h = h + y
        return h * y


def get_inputs():
    return [torch.rand(batch_size, in_features), torch.rand(batch_size, out_features)]


def get_init_inputs():
    return [in_features, out_features]
