"""Generative and scientific-ML MLPs (VAE, flows, PINNs, SIREN, Fourier features,
NeRF-style heads) and normalisation variants people put after a Linear."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import CONVERTS, REFUSED, case, randn


# the pytorch/examples VAE encoder
class VAEEncoder(nn.Module):
    def __init__(self):
        super(VAEEncoder, self).__init__()
        self.fc1 = nn.Linear(49, 40)
        self.fc21 = nn.Linear(40, 6)
        self.fc22 = nn.Linear(40, 6)

    def forward(self, x):
        h1 = F.relu(self.fc1(x.view(-1, 49)))
        return self.fc21(h1), self.fc22(h1)


@case(VAEEncoder, CONVERTS, style="pytorch/examples VAE encode")
def make_vae_enc(cls=VAEEncoder, batch=5):
    return cls(), (torch.rand(batch, 1, 7, 7),)


# encoder + reparameterisation (random in training, mean in eval)
class VAEReparam(nn.Module):
    def __init__(self, d_in, d_hidden, d_latent):
        super().__init__()
        self.enc = nn.Linear(d_in, d_hidden)
        self.mu = nn.Linear(d_hidden, d_latent)
        self.logvar = nn.Linear(d_hidden, d_latent)

    def reparameterize(self, mu, logvar):
        if self.training:
            std = torch.exp(0.5 * logvar)
            eps = torch.randn_like(std)
            return mu + eps * std
        return mu

    def forward(self, x):
        h = F.leaky_relu(self.enc(x), 0.2)
        mu, logvar = self.mu(h), self.logvar(h)
        return self.reparameterize(mu, logvar), mu, logvar


@case(VAEReparam, {"eval": CONVERTS, "train": REFUSED}, style="VAE reparameterisation")
def make_vae_rep(cls=VAEReparam, batch=5):
    return cls(20, 32, 4), (randn(batch, 20),)


# decoder
class VAEDecoder(nn.Module):
    def __init__(self, z_dim, hidden, out_dim):
        super().__init__()
        self.fc3 = nn.Linear(z_dim, hidden)
        self.fc4 = nn.Linear(hidden, out_dim)

    def forward(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))


@case(VAEDecoder, CONVERTS, style="pytorch/examples VAE decode")
def make_vae_dec(cls=VAEDecoder, batch=5):
    return cls(6, 40, 49), (randn(batch, 6),)


# RealNVP affine coupling on vectors
class AffineCoupling(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim // 2, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Linear(hidden, dim - dim // 2 + dim - dim // 2))

    def forward(self, x):
        x1, x2 = x.chunk(2, dim=1)
        h = self.net(x1)
        s, t = h.chunk(2, dim=1)
        s = torch.tanh(s)
        y2 = x2 * torch.exp(s) + t
        log_det = s.sum(dim=1)
        return torch.cat([x1, y2], dim=1), log_det


@case(AffineCoupling, CONVERTS, style="RealNVP on 2-D / tabular data")
def make_coupling(cls=AffineCoupling, batch=5):
    return cls(8, 24), (randn(batch, 8),)


# PINN: tanh MLP on cat(x, t)
class PINN(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.activation = nn.Tanh()
        self.linears = nn.ModuleList([nn.Linear(layers[i], layers[i + 1]) for i in range(len(layers) - 1)])
        for lin in self.linears:
            nn.init.xavier_normal_(lin.weight, gain=1.0)
            nn.init.zeros_(lin.bias)

    def forward(self, x, t):
        a = torch.cat([x, t], dim=1)
        for i in range(len(self.linears) - 1):
            z = self.linears[i](a)
            a = self.activation(z)
        return self.linears[-1](a)


@case(PINN, CONVERTS, style="PINN tutorials (Burgers)")
def make_pinn(cls=PINN, batch=5):
    return cls([2, 20, 20, 20, 1]), (torch.rand(batch, 1) * 2 - 1, torch.rand(batch, 1))


# SIREN
class SineLayer(nn.Module):
    def __init__(self, in_features, out_features, bias=True, is_first=False, omega_0=30):
        super().__init__()
        self.omega_0 = omega_0
        self.is_first = is_first
        self.in_features = in_features
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        with torch.no_grad():
            if self.is_first:
                self.linear.weight.uniform_(-1 / self.in_features, 1 / self.in_features)
            else:
                self.linear.weight.uniform_(-np.sqrt(6 / self.in_features) / self.omega_0,
                                            np.sqrt(6 / self.in_features) / self.omega_0)

    def forward(self, input):
        return torch.sin(self.omega_0 * self.linear(input))


class Siren(nn.Module):
    def __init__(self, in_features, hidden_features, hidden_layers, out_features, first_omega_0=30,
                 hidden_omega_0=30.):
        super().__init__()
        self.net = []
        self.net.append(SineLayer(in_features, hidden_features, is_first=True, omega_0=first_omega_0))
        for i in range(hidden_layers):
            self.net.append(SineLayer(hidden_features, hidden_features, is_first=False, omega_0=hidden_omega_0))
        final_linear = nn.Linear(hidden_features, out_features)
        with torch.no_grad():
            final_linear.weight.uniform_(-np.sqrt(6 / hidden_features) / hidden_omega_0,
                                         np.sqrt(6 / hidden_features) / hidden_omega_0)
        self.net.append(final_linear)
        self.net = nn.Sequential(*self.net)

    def forward(self, coords):
        output = self.net(coords)
        return output


@case(Siren, CONVERTS, style="vsitzmann/siren explore_siren")
def make_siren(cls=Siren, batch=5):
    return cls(2, 24, 2, 1), (torch.rand(batch, 2) * 2 - 1,)


# Fourier features: a fixed Gaussian matrix buffer, sin/cos, MLP
class FourierFeatureMLP(nn.Module):
    def __init__(self, in_dim, n_freq, hidden, out_dim, scale=10.0):
        super().__init__()
        self.register_buffer("B", torch.randn(n_freq, in_dim) * scale)
        self.mlp = nn.Sequential(nn.Linear(2 * n_freq, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Linear(hidden, out_dim), nn.Sigmoid())

    def forward(self, x):
        x_proj = (2. * np.pi * x) @ self.B.T
        return self.mlp(torch.cat([torch.sin(x_proj), torch.cos(x_proj)], dim=-1))


@case(FourierFeatureMLP, CONVERTS, style="Fourier feature networks (Tancik et al.) colab")
def make_fourier(cls=FourierFeatureMLP, batch=5):
    return cls(2, 16, 32, 3, scale=2.0), (torch.rand(batch, 2),)


# NeRF-like: positional encoding of sample points (B, S, 3), density and colour
class TinyNeRF(nn.Module):
    def __init__(self, n_freqs=3, hidden=32):
        super().__init__()
        self.n_freqs = n_freqs
        d_in = 3 + 3 * 2 * n_freqs
        self.layers = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.out = nn.Linear(hidden, 4)

    def encode(self, x):
        out = [x]
        for i in range(self.n_freqs):
            for fn in (torch.sin, torch.cos):
                out.append(fn((2.0 ** i) * x))
        return torch.cat(out, dim=-1)

    def forward(self, pts):
        h = self.layers(self.encode(pts))
        raw = self.out(h)
        sigma = F.relu(raw[..., 0])
        rgb = torch.sigmoid(raw[..., 1:])
        return rgb, sigma


@case(TinyNeRF, CONVERTS, style="tiny NeRF notebooks")
def make_nerf(cls=TinyNeRF, batch=5):
    return cls(), (torch.rand(batch, 6, 3) * 2 - 1,)


# GroupNorm after a Linear, SiLU
class GNMLP(nn.Module):
    def __init__(self, d_in, d_hidden, groups, d_out):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.gn = nn.GroupNorm(groups, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(F.silu(self.gn(self.fc1(x))))


@case(GNMLP, CONVERTS, style="diffusion-model time embedding MLPs")
def make_gnmlp(cls=GNMLP, batch=5):
    return cls(10, 32, 4, 8), (randn(batch, 10),)


# diffusion timestep embedding: sinusoidal features computed from t, then an MLP
class TimestepEmbedding(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.dim = dim
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t):
        half = self.dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(start=0, end=half, dtype=t.dtype, device=t.device) / half)
        args = t[:, None] * freqs[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(embedding)


@case(TimestepEmbedding, CONVERTS, style="guided-diffusion timestep_embedding + MLP (freqs in t's dtype)")
def make_timestep(cls=TimestepEmbedding, batch=5):
    return cls(16, 24), (torch.randint(0, 1000, (batch,)).float(),)


# InstanceNorm1d on a (B, 1, N) view of a Linear output
class InstanceNormHead(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.inorm = nn.InstanceNorm1d(1, affine=False)

    def forward(self, x):
        h = self.fc(x)
        return self.inorm(h.unsqueeze(1)).squeeze(1)


@case(InstanceNormHead, CONVERTS, style="InstanceNorm on features")
def make_inorm(cls=InstanceNormHead, batch=5):
    return cls(13, 22), (randn(batch, 13),)


# F.layer_norm with the shape taken from the tensor
class FunctionalLNHead(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x):
        h = self.fc(x)
        h = F.layer_norm(h, h.shape[-1:])
        return F.elu(h)


@case(FunctionalLNHead, CONVERTS, style="functional layer_norm")
def make_fln(cls=FunctionalLNHead, batch=5):
    return cls(11, 19), (randn(batch, 11),)


# cumulative-average BatchNorm (momentum=None)
class CumulativeBNNet(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.bn = nn.BatchNorm1d(d_out, momentum=None)

    def forward(self, x):
        return F.relu6(self.bn(self.fc(x)))


@case(CumulativeBNNet, CONVERTS, style="BatchNorm momentum=None", batches=(2, 7))
def make_cbn(cls=CumulativeBNNet, batch=7):
    return cls(9, 15), (randn(batch, 9),)


# BatchNorm1d over (B, S, F) via transposes (time-series code)
class SeqBNProjection(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.proj = nn.Linear(d_in, d_out)
        self.bn = nn.BatchNorm1d(d_out)

    def forward(self, x):
        h = self.proj(x)
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        return F.gelu(h)


@case(SeqBNProjection, CONVERTS, style="time-series transformers (BatchNorm over channels)", batches=(2, 5),
      nonfinite_devices=("cuda",),
      notes="CPU NaN/inf check left out: torch's CPU float32 F.gelu(+inf) is NaN on a "
            "contiguous tensor (its vectorised path, which the fused CPU path takes) and "
            "+inf on the transposed one eager computes it on (and on CUDA, and in float64)")
def make_seqbn(cls=SeqBNProjection, batch=5):
    return cls(8, 12), (randn(batch, 6, 8),)


# Bayes-by-backprop linear: mean weights in eval, sampled in training
class BayesianLinear(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.weight_mu = nn.Parameter(torch.Tensor(out_features, in_features).uniform_(-0.2, 0.2))
        self.weight_rho = nn.Parameter(torch.Tensor(out_features, in_features).uniform_(-5, -4))
        self.bias_mu = nn.Parameter(torch.Tensor(out_features).uniform_(-0.2, 0.2))
        self.bias_rho = nn.Parameter(torch.Tensor(out_features).uniform_(-5, -4))

    def forward(self, input):
        if self.training:
            w_sigma = torch.log1p(torch.exp(self.weight_rho))
            b_sigma = torch.log1p(torch.exp(self.bias_rho))
            weight = self.weight_mu + w_sigma * torch.randn_like(w_sigma)
            bias = self.bias_mu + b_sigma * torch.randn_like(b_sigma)
        else:
            weight, bias = self.weight_mu, self.bias_mu
        return F.linear(input, weight, bias)


class BayesianMLP(nn.Module):
    def __init__(self, d_in, d_hidden, d_out):
        super().__init__()
        self.l1 = BayesianLinear(d_in, d_hidden)
        self.l2 = BayesianLinear(d_hidden, d_out)

    def forward(self, x):
        return F.log_softmax(self.l2(torch.sigmoid(self.l1(x))), dim=1)


@case(BayesianMLP, {"eval": CONVERTS, "train": REFUSED}, style="Bayes by Backprop tutorials")
def make_bbb(cls=BayesianMLP, batch=5):
    return cls(12, 20, 4), (randn(batch, 12),)


# hyperbolic-ish: map to the Poincaré ball with tanh of the norm
class PoincareProjection(nn.Module):
    def __init__(self, d_in, d_out, c=1.0):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.c = c

    def expmap0(self, u):
        sqrt_c = self.c ** 0.5
        u_norm = torch.clamp_min(u.norm(dim=-1, p=2, keepdim=True), 1e-5)
        gamma_1 = torch.tanh(sqrt_c * u_norm) * u / (sqrt_c * u_norm)
        return gamma_1

    def forward(self, x):
        return self.expmap0(self.fc(x))


@case(PoincareProjection, CONVERTS, style="hyperbolic embeddings (hyptorch expmap0)")
def make_poincare(cls=PoincareProjection, batch=5):
    return cls(10, 7), (randn(batch, 10),)


# RBF output layer: distance of a Linear embedding to learned centres (expanded form)
class RBFHead(nn.Module):
    def __init__(self, d_in, d_emb, n_centres, gamma=0.5):
        super().__init__()
        self.embed = nn.Linear(d_in, d_emb)
        self.centres = nn.Parameter(torch.randn(n_centres, d_emb))
        self.gamma = gamma

    def forward(self, x):
        z = self.embed(x)
        d2 = (z ** 2).sum(1, keepdim=True) - 2 * z @ self.centres.t() + (self.centres ** 2).sum(1)
        return torch.exp(-self.gamma * d2)


@case(RBFHead, CONVERTS, style="DUQ / RBF networks")
def make_rbf(cls=RBFHead, batch=5):
    return cls(9, 6, 5), (randn(batch, 9, scale=0.5),)
