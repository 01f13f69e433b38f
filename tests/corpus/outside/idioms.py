"""Small idioms seen in the wild around a Linear: legacy implicit-dim softmax, in-place
updates, addmm with alpha/beta, tied and shared weights, pooling with ceil_mode/padding,
cosine similarity and pairwise distance, batch-dim statistics (Barlow Twins), masks."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import CONVERTS, REFUSED, case, randn, token_mask


# old code: softmax without dim (implicit dim=1 on 2-D input, with a warning)
class LegacySoftmax(nn.Module):
    def __init__(self, d_in, n):
        super().__init__()
        self.fc = nn.Linear(d_in, n)
        self.sm = nn.Softmax()

    def forward(self, x):
        return self.sm(self.fc(x)), F.log_softmax(self.fc(x))


@case(LegacySoftmax, CONVERTS, style="pre-0.3 PyTorch code (implicit softmax dim)")
def make_legacy_softmax(cls=LegacySoftmax, batch=5):
    return cls(9, 6), (randn(batch, 9),)


# same on a 3-D input: torch's implicit dim is 0 there (over the batch!)
class LegacySoftmax3d(nn.Module):
    def __init__(self, d_in, n):
        super().__init__()
        self.proj = nn.Linear(d_in, n)

    def forward(self, x):
        return F.softmax(self.proj(x))


@case(LegacySoftmax3d, REFUSED, style="legacy implicit dim on (B, S, F)")
def make_legacy_softmax3d(cls=LegacySoftmax3d, batch=5):
    return cls(8, 5), (randn(batch, 4, 8),)


# in-place residual and activation (ResNet-style 'out += identity')
class InplaceResidual(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x):
        identity = x
        out = self.fc1(x)
        out = F.relu(out, inplace=True)
        out = self.fc2(out)
        out += identity
        out.clamp_(min=0)
        return out


@case(InplaceResidual, CONVERTS, style="ResNet-style in-place residual")
def make_inplace(cls=InplaceResidual, batch=5):
    return cls(15), (randn(batch, 15),)


# addmm with beta/alpha keywords
class ScaledAddmm(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / math.sqrt(d_in))
        self.bias = nn.Parameter(torch.randn(d_out))

    def forward(self, x):
        return torch.tanh(torch.addmm(self.bias, x, self.weight.t(), beta=0.5, alpha=2.0))


@case(ScaledAddmm, CONVERTS, style="addmm with beta/alpha")
def make_addmm(cls=ScaledAddmm, batch=5):
    return cls(11, 7), (randn(batch, 11),)


# tied-weight autoencoder: decoder uses the encoder's weight transposed
class TiedAutoencoder(nn.Module):
    def __init__(self, d, k):
        super().__init__()
        self.encoder = nn.Linear(d, k)
        self.decoder_bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        h = torch.sigmoid(self.encoder(x))
        return F.linear(h, self.encoder.weight.t(), self.decoder_bias)


@case(TiedAutoencoder, CONVERTS, style="tied-weight autoencoder")
def make_tied(cls=TiedAutoencoder, batch=5):
    return cls(14, 6), (randn(batch, 14),)


# siamese: one Linear applied to two inputs, |a - b|, a classifier
class SiameseMLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(d, h), nn.ReLU())
        self.out = nn.Linear(h, 1)

    def forward(self, x1, x2):
        a = self.embed(x1)
        b = self.embed(x2)
        return torch.sigmoid(self.out(torch.abs(a - b)))


@case(SiameseMLP, CONVERTS, style="siamese networks")
def make_siamese(cls=SiameseMLP, batch=5):
    return cls(10, 16), (randn(batch, 10), randn(batch, 10))


# cosine similarity between two projections of the same input
class CosineGate(nn.Module):
    def __init__(self, d, k):
        super().__init__()
        self.a = nn.Linear(d, k)
        self.b = nn.Linear(d, k)

    def forward(self, x):
        return F.cosine_similarity(self.a(x), self.b(x), dim=-1)


@case(CosineGate, CONVERTS, style="F.cosine_similarity of two heads")
def make_cosgate(cls=CosineGate, batch=5):
    return cls(12, 8), (randn(batch, 12),)


# pairwise distance (adds eps to the difference)
class PairwiseDistanceHead(nn.Module):
    def __init__(self, d, k):
        super().__init__()
        self.proj = nn.Linear(d, k)
        self.dist = nn.PairwiseDistance(p=2)

    def forward(self, anchor, positive):
        return self.dist(self.proj(anchor), self.proj(positive))


@case(PairwiseDistanceHead, CONVERTS, style="triplet/siamese distance")
def make_pdist(cls=PairwiseDistanceHead, batch=5):
    return cls(9, 5), (randn(batch, 9), randn(batch, 9))


# Barlow Twins: normalise along the batch dim (z - mean(0)) / std(0)
class BarlowProjector(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(d, h, bias=False), nn.BatchNorm1d(h), nn.ReLU(), nn.Linear(h, h))

    def forward(self, x):
        z = self.proj(x)
        return (z - z.mean(0)) / z.std(0)


@case(BarlowProjector, REFUSED, style="Barlow Twins batch-dim standardisation", batches=(3, 6))
def make_barlow(cls=BarlowProjector, batch=6):
    return cls(10, 12), (randn(batch, 10),)


# functional batch norm with batch statistics and no buffers
class FunctionalBN(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.fc = nn.Linear(d, h)
        self.gamma = nn.Parameter(torch.rand(h) + 0.5)
        self.beta = nn.Parameter(torch.randn(h) * 0.1)

    def forward(self, x):
        return F.batch_norm(self.fc(x), None, None, self.gamma, self.beta, training=True)


@case(FunctionalBN, CONVERTS, style="F.batch_norm without running stats", batches=(2, 7))
def make_fbn(cls=FunctionalBN, batch=7):
    return cls(8, 11), (randn(batch, 8),)


# max pooling over the features with ceil_mode
class CeilPoolHead(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.fc = nn.Linear(d, n)
        self.pool = nn.MaxPool1d(kernel_size=3, stride=2, ceil_mode=True)

    def forward(self, x):
        h = self.fc(x).unsqueeze(1)
        return self.pool(h).squeeze(1)


@case(CeilPoolHead, CONVERTS, style="MaxPool1d ceil_mode")
def make_ceilpool(cls=CeilPoolHead, batch=5):
    return cls(7, 10), (randn(batch, 7),)


# average pooling with padding (count_include_pad default True)
class PaddedAvgPool(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.fc = nn.Linear(d, n)

    def forward(self, x):
        h = F.gelu(self.fc(x))
        return F.avg_pool1d(h.unsqueeze(1), kernel_size=4, stride=2, padding=1).squeeze(1)


@case(PaddedAvgPool, CONVERTS, style="avg_pool1d with padding")
def make_padpool(cls=PaddedAvgPool, batch=5):
    return cls(7, 13), (randn(batch, 7),)


# adaptive max pooling to a size that does not divide the features
class AdaptivePoolHead(nn.Module):
    def __init__(self, d, n, out):
        super().__init__()
        self.fc = nn.Linear(d, n)
        self.pool = nn.AdaptiveMaxPool1d(out)

    def forward(self, x):
        return self.pool(self.fc(x)[:, None, :]).flatten(1)


@case(AdaptivePoolHead, CONVERTS, style="AdaptiveMaxPool1d, uneven bins")
def make_adapool(cls=AdaptivePoolHead, batch=5):
    return cls(6, 14, 4), (randn(batch, 6),)


# strided and fancy feature selection
class FeaturePicker(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.fc = nn.Linear(d, n)
        self.register_buffer("idx", torch.tensor([0, 3, 4, 9]))

    def forward(self, x):
        h = self.fc(x)
        return h[:, ::2] .sum(-1, keepdim=True) + h[:, self.idx].mean(-1, keepdim=True), h[..., -3:]


@case(FeaturePicker, REFUSED, style="feature selection by index")
def make_picker(cls=FeaturePicker, batch=5):
    return cls(6, 11), (randn(batch, 6),)


# masked softmax with a boolean mask input, a fully masked row gives NaN as in torch
class MaskedSoftmaxHead(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.fc = nn.Linear(d, n)

    def forward(self, x, valid):
        logits = self.fc(x).masked_fill(~valid, float("-inf"))
        return torch.softmax(logits, dim=-1)


@case(MaskedSoftmaxHead, CONVERTS, style="action masking in RL (invalid actions)")
def make_masked_sm(cls=MaskedSoftmaxHead, batch=5):
    valid = torch.rand(batch, 6) > 0.3
    valid[:, 0] = True
    return cls(8, 6), (randn(batch, 8), valid)


# softmax with dtype= (HF attention style) and log of a clamped probability
class DtypeSoftmax(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.fc = nn.Linear(d, n)

    def forward(self, x):
        p = nn.functional.softmax(self.fc(x), dim=-1, dtype=torch.float32)
        return torch.log(torch.clamp(p, min=1e-8))


@case(DtypeSoftmax, CONVERTS, style="softmax(dtype=torch.float32)")
def make_dtype_sm(cls=DtypeSoftmax, batch=5):
    return cls(10, 7), (randn(batch, 10, scale=4.0),)


# softplus with beta and threshold, elu with alpha, celu
class ParamActivations(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.fc = nn.Linear(d, n)

    def forward(self, x):
        h = self.fc(x)
        return F.softplus(h, beta=2.0, threshold=5.0) + F.elu(h, alpha=0.5) + F.celu(h, alpha=1.5)


@case(ParamActivations, CONVERTS, style="activation keyword arguments")
def make_param_act(cls=ParamActivations, batch=5):
    return cls(9, 12), (randn(batch, 9, scale=3.0),)


# p-norms by position and by keyword, vector_norm of order 3
class NormZoo(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.fc = nn.Linear(d, n)

    def forward(self, x):
        h = self.fc(x)
        return torch.stack([h.norm(2, 1), h.norm(p=1, dim=1), h.norm(p=float("inf"), dim=1),
                            torch.linalg.vector_norm(h, ord=3, dim=-1)], dim=1)


@case(NormZoo, CONVERTS, style="norms written many ways")
def make_normzoo(cls=NormZoo, batch=5):
    return cls(8, 10), (randn(batch, 8),)


# same Linear unrolled several times (weight-tied recurrence over depth)
class UnrolledTied(nn.Module):
    def __init__(self, d, steps=3):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.rec = nn.Linear(d, d)
        self.steps = steps

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for _ in range(self.steps):
            h = torch.tanh(self.rec(h) + x)
        return h


@case(UnrolledTied, CONVERTS, style="weight-tied unrolled refinement")
def make_unrolled(cls=UnrolledTied, batch=5):
    return cls(13), (randn(batch, 13),)


# squeeze-excitation on a feature vector
class FeatureSE(nn.Module):
    def __init__(self, d, reduction=4):
        super().__init__()
        self.fc1 = nn.Linear(d, d // reduction)
        self.fc2 = nn.Linear(d // reduction, d)

    def forward(self, x):
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(x))))
        return x * s


@case(FeatureSE, CONVERTS, style="SE block on tabular features")
def make_fse(cls=FeatureSE, batch=5):
    return cls(16), (randn(batch, 16),)


# GroupNorm(1, C) as a LayerNorm replacement and a PReLU per channel
class GN1PReLU(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.fc = nn.Linear(d, n)
        self.norm = nn.GroupNorm(1, n)
        self.act = nn.PReLU(n)

    def forward(self, x):
        return self.act(self.norm(self.fc(x)))


@case(GN1PReLU, CONVERTS, style="GroupNorm(1, C) + PReLU(C)")
def make_gn1(cls=GN1PReLU, batch=5):
    m = cls(9, 14)
    with torch.no_grad():
        m.act.weight.uniform_(0.0, 0.5)
    return m, (randn(batch, 9),)


# a bias-only shift with .size() arithmetic: mean via sum / size
class SizeArithmetic(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.fc = nn.Linear(d, n)

    def forward(self, x):
        h = self.fc(x)
        mean = h.sum(-1, keepdim=True) / h.size(-1)
        var = ((h - mean) ** 2).sum(-1, keepdim=True) / (h.shape[-1] - 1)
        return (h - mean) / torch.sqrt(var + 1e-5)


@case(SizeArithmetic, CONVERTS, style="statistics written with .size()")
def make_sizearith(cls=SizeArithmetic, batch=5):
    return cls(7, 12), (randn(batch, 7),)


# new_ones / bias column appended (homogeneous coordinates)
class HomogeneousHead(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.fc = nn.Linear(d, n)
        self.out = nn.Linear(n + 1, 2, bias=False)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        h = torch.cat([h, h.new_ones(h.size(0), 1)], dim=1)
        return self.out(h)


@case(HomogeneousHead, CONVERTS, style="homogeneous coordinate column")
def make_homog(cls=HomogeneousHead, batch=5):
    return cls(6, 9), (randn(batch, 6),)


# float mask with masked_fill(~mask.bool(), -1e9) before a softmax over the sequence
class MaskedAttnPoolFloat(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.proj = nn.Linear(d, h)
        self.score = nn.Linear(h, 1)

    def forward(self, x, mask):
        h = torch.tanh(self.proj(x))
        s = self.score(h).squeeze(-1).masked_fill(~mask.bool(), -1e9)
        a = torch.softmax(s, dim=1)
        return torch.einsum("bs,bsd->bd", a, h)


@case(MaskedAttnPoolFloat, CONVERTS, style="attention pooling with -1e9 masking")
def make_maskpool_f(cls=MaskedAttnPoolFloat, batch=5):
    return cls(10, 12), (randn(batch, 6, 10), token_mask(batch, 6, torch.float))


# logsumexp normalisation with math.log of the width
class LSEPool(nn.Module):
    def __init__(self, d, n, r=2.0):
        super().__init__()
        self.fc = nn.Linear(d, n)
        self.r = r

    def forward(self, x):
        h = self.fc(x)
        return (torch.logsumexp(self.r * h, dim=1) - math.log(h.shape[1])) / self.r


@case(LSEPool, CONVERTS, style="log-sum-exp pooling (smooth max)")
def make_lsepool(cls=LSEPool, batch=5):
    return cls(8, 9), (randn(batch, 8, scale=3.0),)


# threshold / hardshrink / where-based leaky
class ThresholdZoo(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.fc = nn.Linear(d, n)
        self.th = nn.Threshold(0.1, -1.0)

    def forward(self, x):
        h = self.fc(x)
        leaky = torch.where(h > 0, h, 0.01 * h)
        return self.th(h) + F.hardshrink(h, 0.3) + leaky.masked_fill(h.abs() < 0.05, 0.0)


@case(ThresholdZoo, CONVERTS, style="thresholding idioms")
def make_threshold(cls=ThresholdZoo, batch=5):
    return cls(7, 10), (randn(batch, 7),)
