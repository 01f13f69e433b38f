"""Heads that split the features into groups: capsules, mixture density networks,
distributional RL, grouped softmaxes, per-head norms, mixture of softmaxes."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import CONVERTS, REFUSED, case, randn


# primary capsules from a Linear with the squash non-linearity
def squash(input_tensor, dim=-1):
    squared_norm = (input_tensor ** 2).sum(dim, keepdim=True)
    scale = squared_norm / (1 + squared_norm)
    return scale * input_tensor / torch.sqrt(squared_norm + 1e-8)


class LinearCapsules(nn.Module):
    def __init__(self, in_features, num_caps, caps_dim):
        super().__init__()
        self.num_caps, self.caps_dim = num_caps, caps_dim
        self.fc = nn.Linear(in_features, num_caps * caps_dim)

    def forward(self, x):
        u = self.fc(x).view(x.size(0), self.num_caps, self.caps_dim)
        v = squash(u)
        lengths = v.norm(dim=-1)
        return v, lengths


@case(LinearCapsules, CONVERTS, style="capsule network re-implementations")
def make_capsules(cls=LinearCapsules, batch=5):
    return cls(16, 6, 4), (randn(batch, 16),)


# mixture density network (view with -1 for the batch)
class MDN(nn.Module):
    def __init__(self, in_features, out_features, num_gaussians, hidden=32):
        super(MDN, self).__init__()
        self.out_features, self.num_gaussians = out_features, num_gaussians
        self.trunk = nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh())
        self.pi = nn.Linear(hidden, num_gaussians)
        self.sigma = nn.Linear(hidden, out_features * num_gaussians)
        self.mu = nn.Linear(hidden, out_features * num_gaussians)

    def forward(self, minibatch):
        h = self.trunk(minibatch)
        pi = F.softmax(self.pi(h), dim=1)
        sigma = torch.exp(self.sigma(h))
        sigma = sigma.view(-1, self.num_gaussians, self.out_features)
        mu = self.mu(h)
        mu = mu.view(-1, self.num_gaussians, self.out_features)
        return pi, sigma, mu


@case(MDN, CONVERTS, style="sagelywizard/pytorch-mdn")
def make_mdn(cls=MDN, batch=5):
    return cls(6, 2, 5), (randn(batch, 6),)


# C51 distributional DQN
class C51(nn.Module):
    def __init__(self, obs_dim, n_actions, n_atoms=11, v_min=-10.0, v_max=10.0):
        super().__init__()
        self.n_actions, self.n_atoms = n_actions, n_atoms
        self.register_buffer("support", torch.linspace(v_min, v_max, n_atoms))
        self.fc = nn.Sequential(nn.Linear(obs_dim, 64), nn.ReLU(), nn.Linear(64, n_actions * n_atoms))

    def forward(self, x):
        q_atoms = self.fc(x).view(-1, self.n_actions, self.n_atoms)
        dist = F.softmax(q_atoms, dim=-1)
        dist = dist.clamp(min=1e-3)
        q = torch.sum(dist * self.support, dim=2)
        return q, dist


@case(C51, CONVERTS, style="C51 in RL tutorials")
def make_c51(cls=C51, batch=5):
    return cls(8, 3), (randn(batch, 8),)


# QR-DQN: quantiles per action, mean over quantiles
class QRDQN(nn.Module):
    def __init__(self, obs_dim, n_actions, n_quantiles=7):
        super().__init__()
        self.n_actions, self.n_quantiles = n_actions, n_quantiles
        self.l1 = nn.Linear(obs_dim, 48)
        self.l2 = nn.Linear(48, n_actions * n_quantiles)

    def forward(self, state):
        B = state.shape[0]
        quantiles = self.l2(F.relu(self.l1(state))).reshape(B, self.n_actions, self.n_quantiles)
        return quantiles.mean(dim=2), quantiles


@case(QRDQN, CONVERTS, style="QR-DQN implementations")
def make_qrdqn(cls=QRDQN, batch=5):
    return cls(10, 4), (randn(batch, 10),)


# multi-label groups: one log_softmax per attribute group
class GroupedSoftmaxHead(nn.Module):
    def __init__(self, d_in, n_groups, n_classes):
        super().__init__()
        self.n_groups, self.n_classes = n_groups, n_classes
        self.fc = nn.Linear(d_in, n_groups * n_classes)

    def forward(self, x):
        B = x.size(0)
        logits = self.fc(x).view(B, self.n_groups, self.n_classes)
        return F.log_softmax(logits, dim=-1)


@case(GroupedSoftmaxHead, CONVERTS, style="attribute recognition heads")
def make_grouped_softmax(cls=GroupedSoftmaxHead, batch=5):
    return cls(14, 4, 5), (randn(batch, 14),)


# per-head LayerNorm (QK-norm style) on (B, S, H*D), flattened back
class HeadNormProjection(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm = nn.LayerNorm(self.head_dim)

    def forward(self, x):
        q = self.proj(x)
        q = q.view(*q.shape[:-1], self.heads, self.head_dim)
        q = self.norm(q)
        return q.flatten(-2)


@case(HeadNormProjection, CONVERTS, style="QK-norm projections (ViT-22B / OLMo)")
def make_head_norm(cls=HeadNormProjection, batch=5):
    return cls(24, 4), (randn(batch, 5, 24),)


# per-head RMS normalisation through reshape, then out projection
class HeadwiseRMSMix(nn.Module):
    def __init__(self, dim, heads, eps=1e-6):
        super().__init__()
        self.heads, self.eps = heads, eps
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        B, D = x.shape
        v = self.to_v(x).reshape(B, self.heads, D // self.heads)
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.to_out(v.reshape(B, D))


@case(HeadwiseRMSMix, CONVERTS, style="per-head normalisation")
def make_headwise_rms(cls=HeadwiseRMSMix, batch=5):
    return cls(20, 5), (randn(batch, 20),)


# maxout via tuple-shape arithmetic, keep the leading dims
class MaxoutSeq(nn.Module):
    def __init__(self, d_in, d_out, k):
        super().__init__()
        self.d_out, self.k = d_out, k
        self.lin = nn.Linear(d_in, d_out * k)

    def forward(self, x):
        shape = list(x.size())
        shape[-1] = self.d_out
        shape.append(self.k)
        out = self.lin(x)
        return out.view(*shape).max(-1)[0]


@case(MaxoutSeq, REFUSED, style="Maxout (seq) gist")
def make_maxout_seq(cls=MaxoutSeq, batch=5):
    return cls(12, 9, 3), (randn(batch, 4, 12),)


# multi-head gating: softmax within each head, flattened
class MultiHeadGate(nn.Module):
    def __init__(self, d_in, heads, d_head):
        super().__init__()
        self.heads = heads
        self.fc = nn.Linear(d_in, heads * d_head)

    def forward(self, x, values):
        B = x.shape[0]
        g = self.fc(x).view(B, self.heads, -1)
        g = F.softmax(g, dim=-1)
        return g.view(B, -1) * values


@case(MultiHeadGate, CONVERTS, style="multi-head gating units")
def make_mh_gate(cls=MultiHeadGate, batch=5):
    return cls(10, 3, 6), (randn(batch, 10), randn(batch, 18))


# mixture of softmaxes (Yang et al. 2018), without the embedding / RNN
class MixtureOfSoftmaxes(nn.Module):
    def __init__(self, nhid, ninp, ntoken, n_experts):
        super().__init__()
        self.n_experts, self.ninp, self.ntoken = n_experts, ninp, ntoken
        self.prior = nn.Linear(nhid, n_experts, bias=False)
        self.latent = nn.Sequential(nn.Linear(nhid, n_experts * ninp), nn.Tanh())
        self.decoder = nn.Linear(ninp, ntoken)

    def forward(self, output):
        latent = self.latent(output)
        logit = self.decoder(latent.view(-1, self.ninp))
        prior_logit = self.prior(output).contiguous().view(-1, self.n_experts)
        prior = F.softmax(prior_logit, -1)
        prob = F.softmax(logit.view(-1, self.ntoken), -1).view(-1, self.n_experts, self.ntoken)
        prob = (prob * prior.unsqueeze(2).expand_as(prob)).sum(1)
        return prob


@case(MixtureOfSoftmaxes, REFUSED, style="zihangdai/mos")
def make_mos(cls=MixtureOfSoftmaxes, batch=5):
    return cls(12, 6, 15, 3), (randn(batch, 12),)


# grouped linear over heads with an einsum on a (G, O, I) weight
class GroupedLinear(nn.Module):
    def __init__(self, d_in, d_out, groups):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.randn(groups, d_out // groups, d_in // groups) * 0.2)
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x):
        B = x.shape[0]
        xg = x.view(B, self.groups, -1)
        y = torch.einsum("bgi,goi->bgo", xg, self.weight)
        return F.relu(y.reshape(B, -1) + self.bias)


@case(GroupedLinear, REFUSED, style="grouped/block-diagonal linear layers")
def make_grouped_linear(cls=GroupedLinear, batch=5):
    return cls(12, 18, 3), (randn(batch, 12),)


# slot-wise softmax over slots (dim=1) of a (B, slots, D) view, a competition
class SlotCompetition(nn.Module):
    def __init__(self, d_in, n_slots, d_slot):
        super().__init__()
        self.n_slots, self.d_slot = n_slots, d_slot
        self.to_slots = nn.Linear(d_in, n_slots * d_slot)

    def forward(self, x):
        s = self.to_slots(x).view(x.shape[0], self.n_slots, self.d_slot)
        attn = s.softmax(dim=1) + 1e-8
        attn = attn / attn.sum(dim=-1, keepdim=True)
        return attn


@case(SlotCompetition, CONVERTS, style="slot-attention-like normalisation")
def make_slots(cls=SlotCompetition, batch=5):
    return cls(11, 4, 5), (randn(batch, 11),)
