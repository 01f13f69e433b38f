"""Models that are legitimately not Linear + tail: convolutions, attention between two
activations, sorting, embeddings, RNNs, data-dependent control flow. Each must be refused
with a TailError. (A cumulative sum along the features (MonotoneQuantiles) is a tail op,
the scan node, argmax labels (Predictor) are int64 results and a top-k router's gate
(TopKRouter) is row maxima and their positions: those models are in heads.py.)"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import REFUSED, case, randn


# TextCNN-ish: Conv1d over the sequence before the classifier
class ConvHead(nn.Module):
    def __init__(self, d, n_filters, n_classes):
        super().__init__()
        self.conv = nn.Conv1d(d, n_filters, kernel_size=3, padding=1)
        self.fc = nn.Linear(n_filters, n_classes)

    def forward(self, x):
        h = F.relu(self.conv(x.transpose(1, 2)))
        h = F.max_pool1d(h, h.size(2)).squeeze(2)
        return self.fc(h)


@case(ConvHead, REFUSED, style="TextCNN")
def make_convhead(cls=ConvHead, batch=5):
    return cls(10, 12, 3), (randn(batch, 7, 10),)


# single-head self-attention: Q K^T between two activations
class SelfAttention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = F.softmax(att, dim=-1)
        return att @ v


@case(SelfAttention, REFUSED, style="minGPT-style attention")
def make_selfattn(cls=SelfAttention, batch=5):
    return cls(12), (randn(batch, 6, 12),)


# CLIP logits: image embeddings times text embeddings transposed
class CLIPLogits(nn.Module):
    def __init__(self, d_img, d_txt, d):
        super().__init__()
        self.img = nn.Linear(d_img, d, bias=False)
        self.txt = nn.Linear(d_txt, d, bias=False)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def forward(self, image_features, text_features):
        i = F.normalize(self.img(image_features), dim=-1)
        t = F.normalize(self.txt(text_features), dim=-1)
        return self.logit_scale.exp() * i @ t.t()


@case(CLIPLogits, REFUSED, style="openai/CLIP logits_per_image")
def make_clip_logits(cls=CLIPLogits, batch=5):
    return cls(14, 10, 8), (randn(batch, 14), randn(batch, 10))


# sorted scores (e.g. a ranking head returning sorted probabilities)
class SortedScores(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.fc = nn.Linear(d, n)

    def forward(self, x):
        p = torch.sigmoid(self.fc(x))
        return torch.sort(p, dim=-1, descending=True).values


@case(SortedScores, REFUSED, style="ranking heads")
def make_sorted(cls=SortedScores, batch=5):
    return cls(9, 7), (randn(batch, 9),)


# fastText-style: embedding bag of token ids, then a Linear
class FastText(nn.Module):
    def __init__(self, vocab, d, n):
        super().__init__()
        self.embedding = nn.EmbeddingBag(vocab, d, mode="mean")
        self.fc = nn.Linear(d, n)

    def forward(self, text, offsets):
        return self.fc(self.embedding(text, offsets))


@case(FastText, REFUSED, style="torchtext text classification tutorial")
def make_fasttext(cls=FastText, batch=5):
    text = torch.randint(0, 30, (batch * 3,))
    offsets = torch.arange(0, batch * 3, 3)
    return cls(30, 8, 4), (text, offsets)


# LSTM classifier
class LSTMClassifier(nn.Module):
    def __init__(self, d, hidden, n):
        super().__init__()
        self.lstm = nn.LSTM(d, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, n)

    def forward(self, x):
        out, (h_n, c_n) = self.lstm(x)
        return self.fc(h_n[-1])


@case(LSTMClassifier, REFUSED, style="LSTM classifier")
def make_lstm(cls=LSTMClassifier, batch=5):
    return cls(6, 10, 3), (randn(batch, 5, 6),)


# data-dependent control flow in forward
class EarlyExit(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.fc1 = nn.Linear(d, n)
        self.fc2 = nn.Linear(n, n)

    def forward(self, x):
        h = self.fc1(x)
        if h.abs().max() > 100:
            return h
        return self.fc2(F.relu(h))


@case(EarlyExit, REFUSED, style="early-exit heuristics")
def make_early_exit(cls=EarlyExit, batch=5):
    return cls(8, 6), (randn(batch, 8),)


# prototypical network distances with cdist
class ProtoHead(nn.Module):
    def __init__(self, d_in, d_emb, n_protos):
        super().__init__()
        self.embed = nn.Linear(d_in, d_emb)
        self.prototypes = nn.Parameter(torch.randn(n_protos, d_emb))

    def forward(self, x):
        z = self.embed(x)
        return -torch.cdist(z, self.prototypes)


@case(ProtoHead, REFUSED, style="prototypical networks")
def make_proto(cls=ProtoHead, batch=5):
    return cls(10, 6, 4), (randn(batch, 10),)
