"""Tabular and tutorial MLPs: Kaggle notebooks, PyTorch tutorials, course code."""
from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import CONVERTS, EVAL, REFUSED, case, randn


# Kaggle tabular: Linear-BN-ReLU-Dropout blocks in one Sequential
class TabularMLP(nn.Module):
    def __init__(self, n_features, n_targets, hidden=(64, 32), dropout=0.3):
        super().__init__()
        layers = []
        prev = n_features
        for h in hidden:
            layers += [nn.Linear(prev, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(dropout)]
            prev = h
        layers.append(nn.Linear(prev, n_targets))
        self.model = nn.Sequential(*layers)

    def forward(self, x):
        return self.model(x)


@case(TabularMLP, CONVERTS, modes=EVAL, style="Kaggle tabular notebook", batches=(1, 6))
def make_tabular(cls=TabularMLP, batch=6):
    m = cls(19, 3, hidden=(37, 21))
    return m, (randn(batch, 19),)


# the same in train mode, dropout off through the config (a common ablation)
@case(TabularMLP, CONVERTS, name="TabularMLP_nodrop", style="Kaggle tabular notebook", batches=(3, 6))
def make_tabular_nodrop(cls=TabularMLP, batch=6):
    return cls(19, 3, hidden=(37, 21), dropout=0.0), (randn(batch, 19),)


# the MNIST tutorial: flatten the image, three Linears, log_softmax
class MnistNet(nn.Module):
    def __init__(self):
        super(MnistNet, self).__init__()
        self.fc1 = nn.Linear(7 * 7, 45)
        self.fc2 = nn.Linear(45, 23)
        self.fc3 = nn.Linear(23, 10)

    def forward(self, x):
        x = x.view(-1, 7 * 7)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = self.fc3(x)
        return F.log_softmax(x, dim=1)


@case(MnistNet, CONVERTS, style="PyTorch MNIST example")
def make_mnist(cls=MnistNet, batch=5):
    return cls(), (torch.rand(batch, 1, 7, 7),)


# the "Training a classifier" tutorial's head (after the convs): torch.flatten(x, 1)
class TutorialHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16 * 3 * 3, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = torch.flatten(x, 1)  # flatten all dimensions except batch
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = self.fc3(x)
        return x


@case(TutorialHead, CONVERTS, style="PyTorch CIFAR tutorial")
def make_tutorial_head(cls=TutorialHead, batch=5):
    return cls(), (randn(batch, 16, 3, 3),)


# binary classifier with sigmoid and squeeze (Titanic-style)
class TitanicNet(nn.Module):
    def __init__(self, input_dim):
        super().__init__()
        self.layer1 = nn.Linear(input_dim, 16)
        self.layer2 = nn.Linear(16, 8)
        self.out = nn.Linear(8, 1)
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.relu(self.layer1(x))
        x = self.relu(self.layer2(x))
        return torch.sigmoid(self.out(x)).squeeze(1)


@case(TitanicNet, CONVERTS, style="Kaggle Titanic")
def make_titanic(cls=TitanicNet, batch=5):
    return cls(11), (randn(batch, 11),)


# regression MLP built from a dict config, ModuleList loop, activation picked by name
class RegressionMLP(nn.Module):
    ACTS = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU, "silu": nn.SiLU}

    def __init__(self, cfg):
        super().__init__()
        dims = [cfg["in_dim"]] + list(cfg["hidden"])
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.act = self.ACTS[cfg["act"]]()
        self.head = nn.Linear(dims[-1], cfg["out_dim"])

    def forward(self, x):
        for layer in self.layers:
            x = self.act(layer(x))
        return self.head(x)


@case(RegressionMLP, CONVERTS, style="config-dict research code")
def make_regression(cls=RegressionMLP, batch=5):
    cfg = {"in_dim": 9, "hidden": [33, 33, 17], "act": "gelu", "out_dim": 2}
    return cls(cfg), (randn(batch, 9),)


# self-normalising network: SELU + AlphaDropout, LeCun-normal init
class SNN(nn.Module):
    def __init__(self, d_in, d_hidden, n_layers, d_out, p=0.05):
        super().__init__()
        blocks = []
        for i in range(n_layers):
            lin = nn.Linear(d_in if i == 0 else d_hidden, d_hidden)
            nn.init.normal_(lin.weight, std=1.0 / math.sqrt(lin.in_features))
            nn.init.zeros_(lin.bias)
            blocks += [lin, nn.SELU(), nn.AlphaDropout(p)]
        self.body = nn.Sequential(*blocks)
        self.out = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.out(self.body(x))


@case(SNN, CONVERTS, modes=EVAL, style="self-normalizing networks reference code")
def make_snn(cls=SNN, batch=5):
    return cls(14, 29, 3, 4), (randn(batch, 14),)


# positive regression target: softplus output + epsilon
class HousePriceNet(nn.Module):
    def __init__(self, n_in):
        super().__init__()
        self.net = nn.Sequential(OrderedDict([
            ("fc1", nn.Linear(n_in, 64)),
            ("act1", nn.LeakyReLU(negative_slope=0.01)),
            ("fc2", nn.Linear(64, 32)),
            ("act2", nn.LeakyReLU(negative_slope=0.01)),
            ("out", nn.Linear(32, 1)),
        ]))

    def forward(self, x):
        return F.softplus(self.net(x)) + 1e-6


@case(HousePriceNet, CONVERTS, style="Kaggle house prices")
def make_house(cls=HousePriceNet, batch=5):
    return cls(23), (randn(batch, 23),)


# multi-task: a shared trunk and a dict of outputs
class MultiTaskMLP(nn.Module):
    def __init__(self, n_in, n_classes, hidden=48):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(inplace=True),
                                   nn.Linear(hidden, hidden), nn.ReLU(inplace=True))
        self.cls_head = nn.Linear(hidden, n_classes)
        self.reg_head = nn.Linear(hidden, 1)

    def forward(self, x):
        z = self.trunk(x)
        return {"log_probs": F.log_softmax(self.cls_head(z), dim=-1),
                "value": self.reg_head(z).squeeze(-1)}


@case(MultiTaskMLP, CONVERTS, style="multi-task research code")
def make_multitask(cls=MultiTaskMLP, batch=5):
    return cls(17, 6), (randn(batch, 17),)


# CORAL ordinal regression: one logit, K-1 learned thresholds
class CoralHead(nn.Module):
    def __init__(self, in_features, num_classes):
        super().__init__()
        self.fc = nn.Linear(in_features, 1, bias=False)
        self.coral_bias = nn.Parameter(torch.arange(num_classes - 1, 0, -1).float() / (num_classes - 1))

    def forward(self, x):
        logits = self.fc(x) + self.coral_bias
        probas = torch.sigmoid(logits)
        return logits, probas


@case(CoralHead, CONVERTS, style="coral-pytorch")
def make_coral(cls=CoralHead, batch=5):
    return cls(13, 7), (randn(batch, 13),)


# heteroscedastic regression: mean and variance from one Linear, chunked
class GaussianHead(nn.Module):
    def __init__(self, d_in, d_out, hidden=32):
        super().__init__()
        self.hidden = nn.Linear(d_in, hidden)
        self.out = nn.Linear(hidden, 2 * d_out)

    def forward(self, x):
        h = torch.relu(self.hidden(x))
        mean, raw_var = torch.chunk(self.out(h), 2, dim=-1)
        var = F.softplus(raw_var) + 1e-6
        return mean, var


@case(GaussianHead, CONVERTS, style="deep ensembles / uncertainty repos")
def make_gaussian(cls=GaussianHead, batch=5):
    return cls(10, 3), (randn(batch, 10),)


# Maxout layer (view with -1 for the batch, max over the pieces)
class Maxout(nn.Module):
    def __init__(self, d_in, d_out, pool_size):
        super().__init__()
        self.d_out, self.pool_size = d_out, pool_size
        self.lin = nn.Linear(d_in, d_out * pool_size)

    def forward(self, inputs):
        out = self.lin(inputs)
        m, i = out.view(-1, self.d_out, self.pool_size).max(dim=2)
        return m


class MaxoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.mo1 = Maxout(20, 24, 3)
        self.mo2 = Maxout(24, 12, 2)
        self.fc = nn.Linear(12, 4)

    def forward(self, x):
        return self.fc(self.mo2(self.mo1(x)))


@case(MaxoutNet, CONVERTS, style="Maxout gist")
def make_maxout(cls=MaxoutNet, batch=5):
    return cls(), (randn(batch, 20),)


# Highway network: two Linears on the same input, a carry gate
class Highway(nn.Module):
    def __init__(self, size, num_layers, f=F.relu):
        super(Highway, self).__init__()
        self.num_layers = num_layers
        self.nonlinear = nn.ModuleList([nn.Linear(size, size) for _ in range(num_layers)])
        self.linear = nn.ModuleList([nn.Linear(size, size) for _ in range(num_layers)])
        self.gate = nn.ModuleList([nn.Linear(size, size) for _ in range(num_layers)])
        self.f = f

    def forward(self, x):
        for layer in range(self.num_layers):
            gate = torch.sigmoid(self.gate[layer](x))
            nonlinear = self.f(self.nonlinear[layer](x))
            linear = self.linear[layer](x)
            x = gate * nonlinear + (1 - gate) * linear
        return x


@case(Highway, CONVERTS, style="kefirski/pytorch_Highway")
def make_highway(cls=Highway, batch=5):
    return cls(27, 2), (randn(batch, 27),)


# DenseNet-style MLP: each layer's output concatenated onto its input
class DenseMLP(nn.Module):
    def __init__(self, d_in, growth, n_layers, n_out):
        super().__init__()
        self.layers = nn.ModuleList()
        d = d_in
        for _ in range(n_layers):
            self.layers.append(nn.Sequential(nn.Linear(d, growth), nn.ReLU()))
            d += growth
        self.classifier = nn.Linear(d, n_out)

    def forward(self, x):
        for layer in self.layers:
            x = torch.cat([x, layer(x)], dim=1)
        return self.classifier(x)


@case(DenseMLP, CONVERTS, style="dense connectivity MLP")
def make_dense(cls=DenseMLP, batch=5):
    return cls(11, 8, 3, 3), (randn(batch, 11),)


# Wide & Deep with two separate inputs
class WideAndDeep(nn.Module):
    def __init__(self, wide_dim, deep_dim, hidden_units=(32, 16)):
        super().__init__()
        self.wide = nn.Linear(wide_dim, 1)
        deep = []
        d = deep_dim
        for h in hidden_units:
            deep.append(nn.Linear(d, h))
            deep.append(nn.ReLU())
            d = h
        deep.append(nn.Linear(d, 1))
        self.deep = nn.Sequential(*deep)

    def forward(self, x_wide, x_deep):
        return torch.sigmoid(self.wide(x_wide) + self.deep(x_deep))


@case(WideAndDeep, CONVERTS, style="Wide&Deep re-implementations")
def make_wide_deep(cls=WideAndDeep, batch=5):
    return cls(30, 12), (torch.bernoulli(torch.full((batch, 30), 0.2)), randn(batch, 12))


# weight norm (old hook API), as in the Mechanisms-of-Action Kaggle notebooks
class MoAModel(nn.Module):
    def __init__(self, num_features, num_targets, hidden_size):
        super(MoAModel, self).__init__()
        self.batch_norm1 = nn.BatchNorm1d(num_features)
        self.dense1 = nn.utils.weight_norm(nn.Linear(num_features, hidden_size))
        self.batch_norm2 = nn.BatchNorm1d(hidden_size)
        self.dropout2 = nn.Dropout(0.2)
        self.dense2 = nn.utils.weight_norm(nn.Linear(hidden_size, hidden_size))
        self.batch_norm3 = nn.BatchNorm1d(hidden_size)
        self.dropout3 = nn.Dropout(0.25)
        self.dense3 = nn.utils.weight_norm(nn.Linear(hidden_size, num_targets))

    def forward(self, x):
        x = self.batch_norm1(x)
        x = F.relu(self.dense1(x))
        x = self.batch_norm2(x)
        x = self.dropout2(x)
        x = F.relu(self.dense2(x))
        x = self.batch_norm3(x)
        x = self.dropout3(x)
        x = self.dense3(x)
        return x


@case(MoAModel, REFUSED, modes=EVAL, style="Kaggle MoA notebook")
def make_moa(cls=MoAModel, batch=5):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = cls(21, 9, 40)
    for bn in (m.batch_norm1, m.batch_norm2, m.batch_norm3):
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    return m, (randn(batch, 21),)


# weight norm through the parametrizations API
class WNClassifier(nn.Module):
    def __init__(self, d_in, d_hidden, n_classes):
        super().__init__()
        wn = nn.utils.parametrizations.weight_norm
        self.fc1 = wn(nn.Linear(d_in, d_hidden))
        self.fc2 = wn(nn.Linear(d_hidden, n_classes))

    def forward(self, x):
        return self.fc2(F.elu(self.fc1(x)))


@case(WNClassifier, CONVERTS, style="parametrizations.weight_norm")
def make_wn(cls=WNClassifier, batch=5):
    m = cls(15, 26, 5)
    with torch.no_grad():
        m.fc1.parametrizations.weight.original0.mul_(1.7)   # g no longer the norm of v
    return m, (randn(batch, 15),)


# GAN discriminator on vectors with spectral norm
class SNDiscriminator(nn.Module):
    def __init__(self, d_in, hidden=64):
        super().__init__()
        sn = nn.utils.spectral_norm
        self.main = nn.Sequential(
            sn(nn.Linear(d_in, hidden)), nn.LeakyReLU(0.2, inplace=True),
            sn(nn.Linear(hidden, hidden)), nn.LeakyReLU(0.2, inplace=True),
            sn(nn.Linear(hidden, 1)))

    def forward(self, x):
        return self.main(x)


@case(SNDiscriminator, REFUSED, style="SN-GAN on tabular/toy data")
def make_sn(cls=SNDiscriminator, batch=5):
    m = cls(12)
    m.train()
    with torch.no_grad():
        for _ in range(3):
            m(torch.randn(4, 12))   # a few power iterations, as after some training
    return m, (randn(batch, 12),)


# a plain GAN generator for toy 2-D data with tanh output scaled
class ToyGenerator(nn.Module):
    def __init__(self, z_dim=8, out_dim=2, scale=4.0):
        super().__init__()
        self.scale = scale
        self.net = nn.Sequential(nn.Linear(z_dim, 64), nn.ReLU(True), nn.Linear(64, 64),
                                 nn.ReLU(True), nn.Linear(64, out_dim), nn.Tanh())

    def forward(self, z):
        return self.net(z) * self.scale


@case(ToyGenerator, CONVERTS, style="GAN on 2-D toy distributions")
def make_toygen(cls=ToyGenerator, batch=5):
    return cls(), (randn(batch, 8),)


# input standardisation with buffers before the first layer
class StandardizedMLP(nn.Module):
    def __init__(self, mean, std, n_out):
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.fc1 = nn.Linear(mean.numel(), 32)
        self.fc2 = nn.Linear(32, n_out)

    def forward(self, x):
        x = (x - self.mean) / self.std
        return self.fc2(torch.tanh(self.fc1(x)))


@case(StandardizedMLP, CONVERTS, style="scientific ML (input normalisation in the model)")
def make_standardized(cls=StandardizedMLP, batch=5):
    m = cls(torch.randn(9) * 3, torch.rand(9) + 0.5, 2)
    return m, (randn(batch, 9, scale=3.0),)


# polynomial features built in forward
class PolyRegression(nn.Module):
    def __init__(self, d, degree=3):
        super().__init__()
        self.degree = degree
        self.fc = nn.Linear(d * degree, 1)

    def forward(self, x):
        feats = torch.cat([x ** i for i in range(1, self.degree + 1)], 1)
        return self.fc(feats)


@case(PolyRegression, CONVERTS, style="polynomial regression tutorial")
def make_poly(cls=PolyRegression, batch=5):
    return cls(4), (randn(batch, 4),)


# temperature scaling wrapper (calibration): logits / T with T a (1,) parameter
class ModelWithTemperature(nn.Module):
    def __init__(self, model):
        super(ModelWithTemperature, self).__init__()
        self.model = model
        self.temperature = nn.Parameter(torch.ones(1) * 1.5)

    def temperature_scale(self, logits):
        temperature = self.temperature.unsqueeze(1).expand(logits.size(0), logits.size(1))
        return logits / temperature

    def forward(self, input):
        logits = self.model(input)
        return self.temperature_scale(logits)


@case(ModelWithTemperature, CONVERTS, style="gpleiss/temperature_scaling")
def make_temperature(cls=ModelWithTemperature, batch=5):
    inner = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
    return cls(inner), (randn(batch, 16),)


# output clamped to a valid range two ways
class ClampedRegressor(nn.Module):
    def __init__(self, d_in):
        super().__init__()
        self.fc1 = nn.Linear(d_in, 24)
        self.fc2 = nn.Linear(24, 3)

    def forward(self, x):
        h = F.hardtanh(self.fc1(x), min_val=-2.0, max_val=2.0)
        y = self.fc2(h)
        return torch.clamp(y, 0.0, 1.0), y.clamp(min=0)


@case(ClampedRegressor, CONVERTS, style="regression with clipped outputs")
def make_clamped(cls=ClampedRegressor, batch=5):
    return cls(7), (randn(batch, 7, scale=2.0),)


# evidential deep learning classification head
class EvidentialHead(nn.Module):
    def __init__(self, d_in, num_classes):
        super().__init__()
        self.num_classes = num_classes
        self.fc = nn.Linear(d_in, num_classes)

    def forward(self, x):
        evidence = F.softplus(self.fc(x))
        alpha = evidence + 1
        S = torch.sum(alpha, dim=1, keepdim=True)
        prob = alpha / S
        uncertainty = self.num_classes / S
        return prob, uncertainty


@case(EvidentialHead, CONVERTS, style="evidential deep learning repos")
def make_evidential(cls=EvidentialHead, batch=5):
    return cls(18, 5), (randn(batch, 18),)


# logit adjustment with a class-prior buffer
class LogitAdjustedClassifier(nn.Module):
    def __init__(self, d_in, class_counts, tau=1.0):
        super().__init__()
        self.fc = nn.Linear(d_in, len(class_counts))
        prior = torch.tensor(class_counts, dtype=torch.float) / sum(class_counts)
        self.register_buffer("log_prior", torch.log(prior))
        self.tau = tau

    def forward(self, x):
        logits = self.fc(x)
        if not self.training:
            logits = logits - self.tau * self.log_prior
        return logits


@case(LogitAdjustedClassifier, CONVERTS, style="long-tail recognition code")
def make_logit_adj(cls=LogitAdjustedClassifier, batch=5):
    return cls(12, [500, 120, 40, 9, 3]), (randn(batch, 12),)


# zero-inflated count head
class ZeroInflatedPoissonHead(nn.Module):
    def __init__(self, d_in, d_hidden=32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, d_hidden), nn.Softplus())
        self.pi = nn.Linear(d_hidden, 1)
        self.rate = nn.Linear(d_hidden, 1)

    def forward(self, x):
        h = self.body(x)
        pi = torch.sigmoid(self.pi(h))
        lam = torch.exp(self.rate(h).clamp(max=10.0))
        mean = (1 - pi) * lam
        return pi, lam, mean


@case(ZeroInflatedPoissonHead, CONVERTS, style="count regression (ecology / insurance)")
def make_zip(cls=ZeroInflatedPoissonHead, batch=5):
    return cls(8), (randn(batch, 8),)


# a binary classifier returning probabilities for two classes with torch.stack
class BinaryProbs(nn.Module):
    def __init__(self, d_in):
        super().__init__()
        self.linear = nn.Linear(d_in, 1)

    def forward(self, x):
        p = torch.sigmoid(self.linear(x)).view(-1)
        return torch.stack([1 - p, p], dim=1)


@case(BinaryProbs, CONVERTS, style="sklearn-like predict_proba")
def make_binprobs(cls=BinaryProbs, batch=5):
    return cls(6), (randn(batch, 6),)


# logistic regression written with a raw parameter matrix and matmul
class LogisticRegression(nn.Module):
    def __init__(self, n_features, n_classes):
        super().__init__()
        self.W = nn.Parameter(torch.randn(n_features, n_classes) * 0.01)
        self.b = nn.Parameter(torch.zeros(n_classes))

    def forward(self, X):
        return F.softmax(torch.matmul(X, self.W) + self.b, dim=1)


@case(LogisticRegression, CONVERTS, style="from-scratch logistic regression")
def make_logreg(cls=LogisticRegression, batch=5):
    m = cls(13, 4)
    with torch.no_grad():
        m.W.normal_()
    return m, (randn(batch, 13),)
