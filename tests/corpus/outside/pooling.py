"""Sequence pooling heads: sentence-transformers, Kaggle NLP notebooks, attention pooling."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import CONVERTS, EVAL, REFUSED, case, randn, token_mask


# sentence-transformers: mean pooling with the int64 attention mask, Dense(tanh), normalise
class SentenceEmbedder(nn.Module):
    def __init__(self, word_dim, out_dim):
        super().__init__()
        self.dense = nn.Linear(word_dim, out_dim)
        self.activation_function = nn.Tanh()

    def mean_pooling(self, token_embeddings, attention_mask):
        input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).float()
        sum_embeddings = torch.sum(token_embeddings * input_mask_expanded, 1)
        sum_mask = torch.clamp(input_mask_expanded.sum(1), min=1e-9)
        return sum_embeddings / sum_mask

    def forward(self, token_embeddings, attention_mask):
        emb = self.mean_pooling(token_embeddings, attention_mask)
        emb = self.activation_function(self.dense(emb))
        return F.normalize(emb, p=2, dim=1)


@case(SentenceEmbedder, CONVERTS, style="sentence-transformers mean pooling + Dense + Normalize")
def make_sentence(cls=SentenceEmbedder, batch=5):
    return cls(24, 16), (randn(batch, 9, 24), token_mask(batch, 9))


# project the tokens first, then masked mean (Kaggle "MeanPooling" class)
class MeanPooling(nn.Module):
    def __init__(self):
        super(MeanPooling, self).__init__()

    def forward(self, last_hidden_state, attention_mask):
        input_mask_expanded = attention_mask.unsqueeze(-1).expand(last_hidden_state.size()).float()
        sum_embeddings = torch.sum(last_hidden_state * input_mask_expanded, 1)
        sum_mask = input_mask_expanded.sum(1)
        sum_mask = torch.clamp(sum_mask, min=1e-9)
        mean_embeddings = sum_embeddings / sum_mask
        return mean_embeddings


class FeedbackHead(nn.Module):
    def __init__(self, hidden_size, n_targets=6):
        super().__init__()
        self.proj = nn.Linear(hidden_size, hidden_size)
        self.pool = MeanPooling()
        self.fc = nn.Linear(hidden_size, n_targets)

    def forward(self, last_hidden_state, attention_mask):
        h = F.gelu(self.proj(last_hidden_state))
        feature = self.pool(h, attention_mask)
        return self.fc(feature)


@case(FeedbackHead, CONVERTS, style="Kaggle Feedback Prize MeanPooling")
def make_feedback(cls=FeedbackHead, batch=5):
    return cls(20), (randn(batch, 8, 20), token_mask(batch, 8))


# CLS token with select(), classifier
class CLSClassifier(nn.Module):
    def __init__(self, hidden, n_classes, p=0.1):
        super().__init__()
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(hidden, n_classes)

    def forward(self, hidden_states):
        cls = hidden_states.select(1, 0)
        return self.fc(self.drop(cls))


@case(CLSClassifier, CONVERTS, modes=EVAL, style="CLS pooling with select")
def make_cls_sel(cls=CLSClassifier, batch=5):
    return cls(22, 5), (randn(batch, 6, 22),)


# max pooling over time after a projection
class MaxOverTime(nn.Module):
    def __init__(self, d_in, d_hidden, n_classes):
        super().__init__()
        self.proj = nn.Linear(d_in, d_hidden)
        self.out = nn.Linear(d_hidden, n_classes)

    def forward(self, x):
        h = torch.relu(self.proj(x))
        pooled, _ = torch.max(h, dim=1)
        return self.out(pooled)


@case(MaxOverTime, CONVERTS, style="max-over-time pooling")
def make_max_time(cls=MaxOverTime, batch=5):
    return cls(15, 27, 4), (randn(batch, 7, 15),)


# masked attention pooling over the inputs with bmm
class AttentionPooling(nn.Module):
    def __init__(self, hidden, n_classes):
        super().__init__()
        self.attn = nn.Linear(hidden, 1)
        self.fc = nn.Linear(hidden, n_classes)

    def forward(self, x, mask):
        w = self.attn(x).squeeze(-1)
        w = w.masked_fill(mask == 0, float("-inf"))
        w = torch.softmax(w, dim=-1)
        pooled = torch.bmm(w.unsqueeze(1), x).squeeze(1)
        return self.fc(pooled)


@case(AttentionPooling, CONVERTS, style="Kaggle attention pooling")
def make_attn_pool(cls=AttentionPooling, batch=5):
    return cls(18, 3), (randn(batch, 7, 18), token_mask(batch, 7))


# Bahdanau-style additive attention pooling over projected states
class AdditiveAttentionPool(nn.Module):
    def __init__(self, d_in, d_attn):
        super().__init__()
        self.W = nn.Linear(d_in, d_attn)
        self.v = nn.Linear(d_attn, 1, bias=False)

    def forward(self, h):
        scores = self.v(torch.tanh(self.W(h)))     # (B, S, 1)
        alpha = F.softmax(scores, dim=1)
        context = (alpha * h).sum(dim=1)
        return context, alpha.squeeze(-1)


@case(AdditiveAttentionPool, CONVERTS, style="HAN / additive attention")
def make_additive(cls=AdditiveAttentionPool, batch=5):
    return cls(14, 9), (randn(batch, 6, 14),)


# last-token pooling after a projection, keyword dim
class LastTokenHead(nn.Module):
    def __init__(self, d_model, n_out):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.score = nn.Linear(d_model, n_out, bias=False)

    def forward(self, hidden):
        logits = self.score(self.ln(hidden))
        return logits[:, -1, :]


@case(LastTokenHead, CONVERTS, style="HF *ForSequenceClassification (last token)")
def make_last_token(cls=LastTokenHead, batch=5):
    return cls(16, 2), (randn(batch, 5, 16),)


# mean and max pooling concatenated
class MeanMaxHead(nn.Module):
    def __init__(self, d, n_out):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(2 * d, n_out)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        avg_pool = torch.mean(h, 1)
        max_pool, _ = torch.max(h, 1)
        return self.fc2(torch.cat((avg_pool, max_pool), 1))


@case(MeanMaxHead, CONVERTS, style="Kaggle toxic-comments heads")
def make_meanmax(cls=MeanMaxHead, batch=5):
    return cls(17, 6), (randn(batch, 9, 17),)


# GeM pooling over the sequence with a learnable p
class GeMText(nn.Module):
    def __init__(self, dim=1, p=3, eps=1e-6):
        super().__init__()
        self.dim = dim
        self.p = nn.Parameter(torch.ones(1) * p)
        self.eps = eps

    def forward(self, x):
        ret = x.clamp(min=self.eps).pow(self.p).mean(self.dim).pow(1.0 / self.p)
        return ret


class GeMHead(nn.Module):
    def __init__(self, d_in, d_hidden, n_out):
        super().__init__()
        self.proj = nn.Linear(d_in, d_hidden)
        self.pool = GeMText()
        self.fc = nn.Linear(d_hidden, n_out)

    def forward(self, x):
        return self.fc(self.pool(F.softplus(self.proj(x))))


@case(GeMHead, CONVERTS, style="Kaggle GeM pooling")
def make_gem(cls=GeMHead, batch=5):
    return cls(12, 20, 3), (randn(batch, 7, 12),)


# weighted layer pooling over stacked hidden states (L, B, S, H)
class WeightedLayerPooling(nn.Module):
    def __init__(self, num_hidden_layers, layer_start: int = 2, layer_weights=None):
        super(WeightedLayerPooling, self).__init__()
        self.layer_start = layer_start
        self.num_hidden_layers = num_hidden_layers
        self.layer_weights = layer_weights if layer_weights is not None \
            else nn.Parameter(torch.tensor([1] * (num_hidden_layers + 1 - layer_start), dtype=torch.float))

    def forward(self, all_hidden_states):
        all_layer_embedding = all_hidden_states[self.layer_start:, :, :, :]
        weight_factor = self.layer_weights.unsqueeze(-1).unsqueeze(-1).unsqueeze(-1).expand(all_layer_embedding.size())
        weighted_average = (weight_factor * all_layer_embedding).sum(dim=0) / self.layer_weights.sum()
        return weighted_average


class WLPHead(nn.Module):
    def __init__(self, num_layers, hidden, n_out):
        super().__init__()
        self.pool = WeightedLayerPooling(num_layers, layer_start=1)
        self.fc = nn.Linear(hidden, n_out)

    def forward(self, all_hidden_states):
        x = self.pool(all_hidden_states)
        return self.fc(x[:, 0])


@case(WLPHead, REFUSED, style="Kaggle CommonLit WeightedLayerPooling")
def make_wlp(cls=WLPHead, batch=5):
    return cls(3, 14, 1), (randn(4, batch, 5, 14),)


# multi-sample dropout head: mean of the same fc over several dropouts
class MultiSampleDropoutHead(nn.Module):
    def __init__(self, hidden, n_out, n_samples=5):
        super().__init__()
        self.dropouts = nn.ModuleList([nn.Dropout(0.1 * (i + 1)) for i in range(n_samples)])
        self.fc = nn.Linear(hidden, n_out)

    def forward(self, x):
        logits = torch.mean(torch.stack([self.fc(self.dropouts[i](x)) for i in range(len(self.dropouts))], dim=0), dim=0)
        return logits


@case(MultiSampleDropoutHead, CONVERTS, modes=EVAL, style="Kaggle multi-sample dropout")
def make_msd(cls=MultiSampleDropoutHead, batch=5):
    return cls(20, 3), (randn(batch, 20),)


# learned-query attention pooling: keys from a Linear, query a parameter vector
class QueryAttentionPool(nn.Module):
    def __init__(self, d_in, d_k):
        super().__init__()
        self.key = nn.Linear(d_in, d_k)
        self.value = nn.Linear(d_in, d_in)
        self.query = nn.Parameter(torch.randn(d_k))

    def forward(self, x):
        scores = self.key(x) @ self.query / (self.query.shape[0] ** 0.5)    # (B, S)
        attn = scores.softmax(dim=-1)
        return (attn.unsqueeze(-1) * self.value(x)).sum(1)


@case(QueryAttentionPool, CONVERTS, style="learned-query pooling")
def make_query_pool(cls=QueryAttentionPool, batch=5):
    return cls(13, 8), (randn(batch, 6, 13),)


# sequence classifier: mean pooling with a float (B, S, 1) mask and a BatchNorm after
class PooledBNClassifier(nn.Module):
    def __init__(self, d_in, d_hidden, n_classes):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d_in, d_hidden), nn.Mish())
        self.bn = nn.BatchNorm1d(d_hidden)
        self.classifier = nn.Linear(d_hidden, n_classes)

    def forward(self, x, mask):
        h = self.encoder(x) * mask
        h = h.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return self.classifier(self.bn(h))


@case(PooledBNClassifier, CONVERTS, style="time-series classifiers", batches=(3, 6))
def make_pooled_bn(cls=PooledBNClassifier, batch=6):
    return cls(9, 21, 4), (randn(batch, 8, 9), token_mask(batch, 8, torch.float).unsqueeze(-1))
