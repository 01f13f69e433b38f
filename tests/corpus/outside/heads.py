"""Classification / projection heads in the style of HF transformers, timm and
self-supervised learning repos (SimCLR, BYOL, DINO, SwAV, MoCo, CLIP)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import CONVERTS, EVAL, REFUSED, case, randn


@dataclass
class HeadConfig:
    hidden_size: int = 40
    num_labels: int = 3
    hidden_dropout_prob: float = 0.1
    classifier_dropout: float | None = None
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    vocab_size: int = 57


class NewGELUActivation(nn.Module):
    """GPT-2 / BERT-original tanh GELU, written out."""

    def forward(self, input):
        return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))


ACT2FN = {"gelu": nn.GELU(), "relu": nn.ReLU(), "gelu_new": NewGELUActivation(),
          "silu": nn.SiLU(), "tanh": nn.Tanh()}


# RobertaClassificationHead: <s> token, dropout, dense, tanh, dropout, out_proj
class RobertaClassificationHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        classifier_dropout = (
            config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        )
        self.dropout = nn.Dropout(classifier_dropout)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, features, **kwargs):
        x = features[:, 0, :]  # take <s> token (equiv. to [CLS])
        x = self.dropout(x)
        x = self.dense(x)
        x = torch.tanh(x)
        x = self.dropout(x)
        x = self.out_proj(x)
        return x


@case(RobertaClassificationHead, CONVERTS, modes=EVAL, style="HF RobertaClassificationHead")
def make_roberta_head(cls=RobertaClassificationHead, batch=5):
    return cls(HeadConfig()), (randn(batch, 7, 40),)


# BertPooler
class BertPooler(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states):
        first_token_tensor = hidden_states[:, 0]
        pooled_output = self.dense(first_token_tensor)
        pooled_output = self.activation(pooled_output)
        return pooled_output


@case(BertPooler, CONVERTS, style="HF BertPooler")
def make_bert_pooler(cls=BertPooler, batch=5):
    return cls(HeadConfig()), (randn(batch, 9, 40),)


# BertPredictionHeadTransform + decoder with a tied bias (BertLMPredictionHead)
class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        if isinstance(config.hidden_act, str):
            self.transform_act_fn = ACT2FN[config.hidden_act]
        else:
            self.transform_act_fn = config.hidden_act
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.transform_act_fn(hidden_states)
        hidden_states = self.LayerNorm(hidden_states)
        return hidden_states


class BertLMPredictionHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.decoder.bias = self.bias

    def forward(self, hidden_states):
        hidden_states = self.transform(hidden_states)
        hidden_states = self.decoder(hidden_states)
        return hidden_states


@case(BertLMPredictionHead, CONVERTS, style="HF BertLMPredictionHead (tied decoder bias)")
def make_bert_lm_head(cls=BertLMPredictionHead, batch=5):
    m = cls(HeadConfig(hidden_act="gelu_new"))
    with torch.no_grad():
        m.bias.uniform_(-1, 1)
    return m, (randn(batch, 6, 40),)


# BertSelfOutput: dense, dropout, LayerNorm(hidden + input_tensor)
class BertSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


@case(BertSelfOutput, CONVERTS, modes=EVAL, style="HF BertSelfOutput")
def make_bert_self_output(cls=BertSelfOutput, batch=5):
    return cls(HeadConfig()), (randn(batch, 5, 40), randn(batch, 5, 40))


# a token-classification head on (B, S, H): dropout, Linear, log_softmax
class TokenClassificationHead(nn.Module):
    def __init__(self, hidden, num_tags, dropout=0.1):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        self.classifier = nn.Linear(hidden, num_tags)

    def forward(self, sequence_output):
        logits = self.classifier(self.dropout(sequence_output))
        return logits.log_softmax(dim=-1)


@case(TokenClassificationHead, CONVERTS, modes=EVAL, style="NER heads")
def make_token_cls(cls=TokenClassificationHead, batch=5):
    return cls(32, 9), (randn(batch, 11, 32),)


# timm-style ClassifierHead over tokens (B, N, C): pool, drop, fc, pre_logits flag
class TimmTokenHead(nn.Module):
    def __init__(self, in_features, num_classes, pool_type="avg", drop_rate=0.0):
        super().__init__()
        self.pool_type = pool_type
        self.drop = nn.Dropout(drop_rate)
        self.fc = nn.Linear(in_features, num_classes) if num_classes > 0 else nn.Identity()

    def forward(self, x, pre_logits: bool = False):
        if self.pool_type == "avg":
            x = x.mean(dim=1)
        elif self.pool_type == "token":
            x = x[:, 0]
        x = self.drop(x)
        if pre_logits:
            return x
        return self.fc(x)


@case(TimmTokenHead, CONVERTS, style="timm ClassifierHead")
def make_timm_head(cls=TimmTokenHead, batch=5):
    return cls(36, 7), (randn(batch, 10, 36),)


# ViT head: final norm on the tokens, class token, head
class ViTHead(nn.Module):
    def __init__(self, embed_dim, num_classes, global_pool="token"):
        super().__init__()
        self.global_pool = global_pool
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head_drop = nn.Dropout(0.0)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward_head(self, x, pre_logits: bool = False):
        if self.global_pool:
            x = x[:, 1:].mean(dim=1) if self.global_pool == "avg" else x[:, 0]
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x):
        x = self.norm(x)
        return self.forward_head(x)


@case(ViTHead, CONVERTS, style="timm VisionTransformer.forward_head")
def make_vit_head(cls=ViTHead, batch=5):
    return cls(24, 5), (randn(batch, 8, 24),)


# XLNet/GPT SequenceSummary, 'last' token summary
class SequenceSummary(nn.Module):
    def __init__(self, hidden_size, num_labels, summary_type="last"):
        super().__init__()
        self.summary_type = summary_type
        self.summary = nn.Linear(hidden_size, num_labels)
        self.activation = nn.Tanh()
        self.first_dropout = nn.Identity()
        self.last_dropout = nn.Dropout(0.1)

    def forward(self, hidden_states):
        if self.summary_type == "last":
            output = hidden_states[:, -1]
        elif self.summary_type == "first":
            output = hidden_states[:, 0]
        elif self.summary_type == "mean":
            output = hidden_states.mean(dim=1)
        output = self.first_dropout(output)
        output = self.summary(output)
        output = self.activation(output)
        output = self.last_dropout(output)
        return output


@case(SequenceSummary, CONVERTS, modes=EVAL, style="HF SequenceSummary")
def make_seq_summary(cls=SequenceSummary, batch=5):
    return cls(28, 4), (randn(batch, 6, 28),)


# cosine classifier (ArcFace backbone output at inference): both normalised
class CosineClassifier(nn.Module):
    def __init__(self, in_features, out_features, s=30.0):
        super().__init__()
        self.s = s
        self.weight = nn.Parameter(torch.FloatTensor(out_features, in_features))
        nn.init.xavier_uniform_(self.weight)

    def forward(self, input):
        cosine = F.linear(F.normalize(input), F.normalize(self.weight))
        return cosine * self.s


@case(CosineClassifier, CONVERTS, style="insightface / arcface-pytorch (inference)")
def make_cosine(cls=CosineClassifier, batch=5):
    return cls(20, 11), (randn(batch, 20),)


# ArcFace with labels, the training-time margin via scatter_ into a one-hot
class ArcMarginProduct(nn.Module):
    def __init__(self, in_features, out_features, s=30.0, m=0.50, easy_margin=False):
        super(ArcMarginProduct, self).__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.s = s
        self.m = m
        self.weight = nn.Parameter(torch.FloatTensor(out_features, in_features))
        nn.init.xavier_uniform_(self.weight)
        self.easy_margin = easy_margin
        self.cos_m = math.cos(m)
        self.sin_m = math.sin(m)
        self.th = math.cos(math.pi - m)
        self.mm = math.sin(math.pi - m) * m

    def forward(self, input, label):
        cosine = F.linear(F.normalize(input), F.normalize(self.weight))
        sine = torch.sqrt((1.0 - torch.pow(cosine, 2)).clamp(0, 1))
        phi = cosine * self.cos_m - sine * self.sin_m
        if self.easy_margin:
            phi = torch.where(cosine > 0, phi, cosine)
        else:
            phi = torch.where(cosine > self.th, phi, cosine - self.mm)
        one_hot = torch.zeros(cosine.size(), device=input.device)
        one_hot.scatter_(1, label.view(-1, 1).long(), 1)
        output = (one_hot * phi) + ((1.0 - one_hot) * cosine)
        output *= self.s
        return output


@case(ArcMarginProduct, CONVERTS, style="ronghuaiyang/arcface-pytorch")
def make_arcface(cls=ArcMarginProduct, batch=5):
    return cls(20, 11), (randn(batch, 20), torch.randint(0, 11, (batch,)))


# CosFace with the one-hot labels passed in as floats
class CosFaceHead(nn.Module):
    def __init__(self, in_features, n_classes, s=64.0, m=0.35):
        super().__init__()
        self.s, self.m = s, m
        self.W = nn.Parameter(torch.randn(n_classes, in_features))

    def forward(self, embeddings, onehot):
        cos = F.normalize(embeddings, dim=1) @ F.normalize(self.W, dim=1).t()
        return self.s * (cos - self.m * onehot)


@case(CosFaceHead, CONVERTS, style="CosFace re-implementations")
def make_cosface(cls=CosFaceHead, batch=5):
    y = torch.randint(0, 9, (batch,))
    return cls(16, 9), (randn(batch, 16), F.one_hot(y, 9).float())


# CLIP projections: project, L2-normalise, scale by exp(logit_scale)
class CLIPProjections(nn.Module):
    def __init__(self, vision_dim, text_dim, proj_dim, logit_scale_init_value=2.6592):
        super().__init__()
        self.visual_projection = nn.Linear(vision_dim, proj_dim, bias=False)
        self.text_projection = nn.Linear(text_dim, proj_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(logit_scale_init_value))

    def forward(self, image_pooled, text_pooled):
        image_embeds = self.visual_projection(image_pooled)
        text_embeds = self.text_projection(text_pooled)
        image_embeds = image_embeds / image_embeds.norm(p=2, dim=-1, keepdim=True)
        text_embeds = text_embeds / text_embeds.norm(p=2, dim=-1, keepdim=True)
        return image_embeds * self.logit_scale.exp(), text_embeds


@case(CLIPProjections, CONVERTS, style="HF CLIPModel projections")
def make_clip_proj(cls=CLIPProjections, batch=5):
    return cls(30, 22, 16), (randn(batch, 30), randn(batch, 22))


# SimCLR v2 projection head: Linear-BN-ReLU, last BN without affine
class SimCLRProjectionHead(nn.Module):
    def __init__(self, in_dim, hidden_dim, out_dim):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_dim, hidden_dim, bias=False), nn.BatchNorm1d(hidden_dim), nn.ReLU(inplace=True),
            nn.Linear(hidden_dim, hidden_dim, bias=False), nn.BatchNorm1d(hidden_dim), nn.ReLU(inplace=True),
            nn.Linear(hidden_dim, out_dim, bias=False), nn.BatchNorm1d(out_dim, affine=False))

    def forward(self, x):
        return self.layers(x)


@case(SimCLRProjectionHead, CONVERTS, style="SimCLRv2 / lightly projection head", batches=(4, 7))
def make_simclr(cls=SimCLRProjectionHead, batch=7):
    return cls(26, 34, 12), (randn(batch, 26),)


# BYOL predictor MLP
class MLPHead(nn.Module):
    def __init__(self, in_channels, mlp_hidden_size, projection_size):
        super(MLPHead, self).__init__()
        self.net = nn.Sequential(
            nn.Linear(in_channels, mlp_hidden_size),
            nn.BatchNorm1d(mlp_hidden_size),
            nn.ReLU(inplace=True),
            nn.Linear(mlp_hidden_size, projection_size)
        )

    def forward(self, x):
        return self.net(x)


@case(MLPHead, CONVERTS, style="sthalles/PyTorch-BYOL", batches=(3, 8))
def make_byol(cls=MLPHead, batch=8):
    return cls(18, 40, 9), (randn(batch, 18),)


# DINO head: MLP with GELU, L2-normalise, weight-normed last layer with g fixed to 1
class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, nlayers=3, hidden_dim=48, bottleneck_dim=16):
        super().__init__()
        nlayers = max(nlayers, 1)
        layers = [nn.Linear(in_dim, hidden_dim)]
        layers.append(nn.GELU())
        for _ in range(nlayers - 2):
            layers.append(nn.Linear(hidden_dim, hidden_dim))
            layers.append(nn.GELU())
        layers.append(nn.Linear(hidden_dim, bottleneck_dim))
        self.mlp = nn.Sequential(*layers)
        self.apply(self._init_weights)
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        self.last_layer.weight_g.requires_grad = False

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.constant_(m.bias, 0)

    def forward(self, x):
        x = self.mlp(x)
        x = nn.functional.normalize(x, dim=-1, p=2)
        x = self.last_layer(x)
        return x


@case(DINOHead, REFUSED, style="facebookresearch/dino DINOHead")
def make_dino(cls=DINOHead, batch=5):
    m = cls(24, 33)
    with torch.no_grad():
        m.last_layer.weight_v.normal_()   # as after training: the stale .weight differs
    return m, (randn(batch, 24),)


# SwAV: normalise the projection, prototypes as a bias-free Linear
class SwAVHead(nn.Module):
    def __init__(self, in_dim, proj_dim, n_prototypes):
        super().__init__()
        self.projection_head = nn.Sequential(nn.Linear(in_dim, 2 * proj_dim), nn.BatchNorm1d(2 * proj_dim),
                                             nn.ReLU(inplace=True), nn.Linear(2 * proj_dim, proj_dim))
        self.prototypes = nn.Linear(proj_dim, n_prototypes, bias=False)

    def forward(self, x):
        x = self.projection_head(x)
        x = nn.functional.normalize(x, dim=1, p=2)
        return x, self.prototypes(x)


@case(SwAVHead, CONVERTS, style="facebookresearch/swav", batches=(2, 6))
def make_swav(cls=SwAVHead, batch=6):
    return cls(20, 10, 15), (randn(batch, 20),)


# MoCo v2 MLP head then normalise (dim=1)
class MoCoHead(nn.Module):
    def __init__(self, dim_mlp, dim):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(dim_mlp, dim_mlp), nn.ReLU(), nn.Linear(dim_mlp, dim))

    def forward(self, feats):
        q = self.fc(feats)
        q = nn.functional.normalize(q, dim=1)
        return q


@case(MoCoHead, CONVERTS, style="facebookresearch/moco")
def make_moco(cls=MoCoHead, batch=5):
    return cls(28, 12), (randn(batch, 28),)


# ResNet fc on a pooled feature map given as (B, C, 1, 1)
class PooledFCHead(nn.Module):
    def __init__(self, num_features, num_classes, drop_rate=0.2):
        super().__init__()
        self.drop_rate = drop_rate
        self.classifier = nn.Linear(num_features, num_classes)

    def forward(self, x):
        x = x.flatten(1)
        if self.drop_rate > 0.:
            x = F.dropout(x, p=self.drop_rate, training=self.training)
        return self.classifier(x)


@case(PooledFCHead, CONVERTS, modes=EVAL, style="EfficientNet classifier after global pooling")
def make_pooled_fc(cls=PooledFCHead, batch=5):
    return cls(32, 6), (randn(batch, 32, 1, 1),)


# the ResNet end: AdaptiveAvgPool2d over a feature map, flatten, fc
class ResNetTail(nn.Module):
    def __init__(self, channels, num_classes):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x):
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return x


@case(ResNetTail, REFUSED, style="torchvision ResNet end")
def make_resnet_tail(cls=ResNetTail, batch=5):
    return cls(16, 5), (randn(batch, 16, 3, 3),)


# ConvNeXt head: mean over H, W, LayerNorm, fc
class ConvNeXtHead(nn.Module):
    def __init__(self, dims, num_classes):
        super().__init__()
        self.norm = nn.LayerNorm(dims, eps=1e-6)
        self.head = nn.Linear(dims, num_classes)

    def forward(self, x):
        x = self.norm(x.mean([-2, -1]))  # global average pooling, (N, C, H, W) -> (N, C)
        return self.head(x)


@case(ConvNeXtHead, REFUSED, style="facebookresearch/ConvNeXt")
def make_convnext_head(cls=ConvNeXtHead, batch=5):
    return cls(20, 4), (randn(batch, 20, 3, 2),)


# HF-style model output class with labels=None default
class ClassifierWithLoss(nn.Module):
    def __init__(self, hidden, num_labels):
        super().__init__()
        self.num_labels = num_labels
        self.pre_classifier = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, num_labels)
        self.dropout = nn.Dropout(0.2)

    def forward(self, pooled, labels=None):
        h = self.pre_classifier(pooled)
        h = nn.ReLU()(h)
        h = self.dropout(h)
        logits = self.classifier(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return (loss, logits) if loss is not None else logits


@case(ClassifierWithLoss, REFUSED, modes=EVAL, style="HF DistilBertForSequenceClassification-style head")
def make_cls_loss(cls=ClassifierWithLoss, batch=5):
    return cls(26, 3), (randn(batch, 26),)


# a projection head with L2-normalised output and a learnable temperature buffer
class ContrastiveProjector(nn.Module):
    def __init__(self, d_in, d_out, temperature=0.07):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(d_in, d_in), nn.GELU(), nn.Linear(d_in, d_out))
        self.register_buffer("inv_tau", torch.tensor(1.0 / temperature))

    def forward(self, x):
        z = self.proj(x)
        z = z / z.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        return z * self.inv_tau.sqrt()


@case(ContrastiveProjector, CONVERTS, style="contrastive learning repos")
def make_contrastive(cls=ContrastiveProjector, batch=5):
    return cls(19, 11), (randn(batch, 7, 19),)


# (a cumulative sum along the features fuses: the scan node)
# monotone quantiles with a cumulative sum of softplus increments
class MonotoneQuantiles(nn.Module):
    def __init__(self, d, n_q):
        super().__init__()
        self.fc = nn.Linear(d, n_q)

    def forward(self, x):
        deltas = self.fc(x)
        first = deltas[:, :1]
        return torch.cat([first, first + torch.cumsum(F.softplus(deltas[:, 1:]), dim=1)], dim=1)


@case(MonotoneQuantiles, CONVERTS, style="quantile regression (non-crossing)")
def make_quantiles(cls=MonotoneQuantiles, batch=5):
    return cls(8, 5), (randn(batch, 8),)


# predicted labels with argmax (int64 positions fuse: tests/frontend/test_argmax.py)
class Predictor(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.fc = nn.Linear(d, n)

    def forward(self, x):
        logits = self.fc(x)
        return logits.argmax(dim=1)


@case(Predictor, CONVERTS, style="predict() wrappers")
def make_argmax(cls=Predictor, batch=5):
    return cls(8, 4), (randn(batch, 8),)


# top-k router (Switch / Mixtral gate)
class TopKRouter(nn.Module):
    def __init__(self, d, n_experts, k=2):
        super().__init__()
        self.gate = nn.Linear(d, n_experts, bias=False)
        self.k = k

    def forward(self, x):
        logits = self.gate(x)
        weights, selected = torch.topk(logits, self.k, dim=-1)
        weights = F.softmax(weights, dim=-1)
        return weights, selected


@case(TopKRouter, CONVERTS, style="Mixtral router")
def make_topk(cls=TopKRouter, batch=5):
    return cls(12, 6), (randn(batch, 12),)
