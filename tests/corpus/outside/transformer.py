"""Feed-forward parts of transformer blocks on (batch, seq, features): the Annotated
Transformer, GPT-2 (HF Conv1D), T5, LLaMA, adapters and LoRA, MLP-Mixer, Mamba-style gating."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import CONVERTS, EVAL, REFUSED, case, randn


# The Annotated Transformer: LayerNorm written by hand, SublayerConnection, FFN
class LayerNorm(nn.Module):
    "Construct a layernorm module (See citation for details)."

    def __init__(self, features, eps=1e-6):
        super(LayerNorm, self).__init__()
        self.a_2 = nn.Parameter(torch.ones(features))
        self.b_2 = nn.Parameter(torch.zeros(features))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.a_2 * (x - mean) / (std + self.eps) + self.b_2


class PositionwiseFeedForward(nn.Module):
    "Implements FFN equation."

    def __init__(self, d_model, d_ff, dropout=0.1):
        super(PositionwiseFeedForward, self).__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.w_2(self.dropout(self.w_1(x).relu()))


class AnnotatedFFNSublayer(nn.Module):
    """x + dropout(ff(norm(x))): SublayerConnection around the FFN."""

    def __init__(self, size, d_ff, dropout=0.1):
        super().__init__()
        self.norm = LayerNorm(size)
        self.dropout = nn.Dropout(dropout)
        self.feed_forward = PositionwiseFeedForward(size, d_ff, dropout)

    def forward(self, x):
        sublayer = self.feed_forward
        return x + self.dropout(sublayer(self.norm(x)))


@case(AnnotatedFFNSublayer, CONVERTS, modes=EVAL, style="harvardnlp Annotated Transformer")
def make_annotated(cls=AnnotatedFFNSublayer, batch=5):
    m = cls(24, 50)
    with torch.no_grad():
        m.norm.a_2.uniform_(0.5, 1.5)
        m.norm.b_2.uniform_(-0.5, 0.5)
    return m, (randn(batch, 7, 24),)


# post-norm block, nn.TransformerEncoderLayer style without attention
class PostNormFFN(nn.Module):
    def __init__(self, d_model, dim_feedforward, dropout=0.0, activation=F.gelu):
        super().__init__()
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm2 = nn.LayerNorm(d_model, eps=1e-5)
        self.dropout2 = nn.Dropout(dropout)
        self.activation = activation

    def _ff_block(self, x):
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return self.dropout2(x)

    def forward(self, src):
        x = src
        x = self.norm2(x + self._ff_block(x))
        return x


@case(PostNormFFN, CONVERTS, style="torch TransformerEncoderLayer._ff_block")
def make_postnorm(cls=PostNormFFN, batch=5):
    return cls(20, 44), (randn(batch, 6, 20),)


# GPT-2 MLP with HF's Conv1D (weight stored (in, out), addmm on a flattened view)
class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        x = x.view(size_out)
        return x


class GPT2MLP(nn.Module):
    def __init__(self, intermediate_size, embed_dim, resid_pdrop=0.1):
        super().__init__()
        self.c_fc = Conv1D(intermediate_size, embed_dim)
        self.c_proj = Conv1D(embed_dim, intermediate_size)
        self.dropout = nn.Dropout(resid_pdrop)

    def act(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

    def forward(self, hidden_states):
        hidden_states = self.c_fc(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.c_proj(hidden_states)
        hidden_states = self.dropout(hidden_states)
        return hidden_states


@case(GPT2MLP, CONVERTS, modes=EVAL, style="HF GPT2MLP with Conv1D")
def make_gpt2_mlp(cls=GPT2MLP, batch=5):
    m = cls(64, 16)
    with torch.no_grad():
        m.c_fc.weight.normal_(std=0.3)
        m.c_proj.weight.normal_(std=0.2)
    return m, (randn(batch, 5, 16),)


# T5: RMS layer norm (T5LayerNorm), DenseReluDense, residual
class T5LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class T5DenseActDense(nn.Module):
    def __init__(self, d_model, d_ff, dropout_rate=0.1):
        super().__init__()
        self.wi = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)
        self.dropout = nn.Dropout(dropout_rate)
        self.act = nn.ReLU()

    def forward(self, hidden_states):
        hidden_states = self.wi(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.wo(hidden_states)
        return hidden_states


class T5LayerFF(nn.Module):
    def __init__(self, d_model, d_ff, dropout_rate=0.1):
        super().__init__()
        self.DenseReluDense = T5DenseActDense(d_model, d_ff, dropout_rate)
        self.layer_norm = T5LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout_rate)

    def forward(self, hidden_states):
        forwarded_states = self.layer_norm(hidden_states)
        forwarded_states = self.DenseReluDense(forwarded_states)
        hidden_states = hidden_states + self.dropout(forwarded_states)
        return hidden_states


@case(T5LayerFF, REFUSED, modes=EVAL, style="HF T5LayerFF")
def make_t5ff(cls=T5LayerFF, batch=5):
    return cls(18, 40), (randn(batch, 6, 18),)


# T5 v1.1 gated-gelu FFN (gelu_new) on the output of an RMS norm
class T5DenseGatedActDense(nn.Module):
    def __init__(self, d_model, d_ff, dropout_rate=0.0):
        super().__init__()
        self.wi_0 = nn.Linear(d_model, d_ff, bias=False)
        self.wi_1 = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)
        self.dropout = nn.Dropout(dropout_rate)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, hidden_states):
        hidden_gelu = self.act(self.wi_0(hidden_states))
        hidden_linear = self.wi_1(hidden_states)
        hidden_states = hidden_gelu * hidden_linear
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.wo(hidden_states)
        return hidden_states


@case(T5DenseGatedActDense, CONVERTS, style="HF T5DenseGatedActDense")
def make_t5_gated(cls=T5DenseGatedActDense, batch=5):
    return cls(20, 36), (randn(batch, 4, 20),)


# LLaMA MLP
class LlamaMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size, hidden_act="silu"):
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = {"silu": nn.SiLU(), "gelu": nn.GELU()}[hidden_act]

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


@case(LlamaMLP, CONVERTS, style="HF LlamaMLP")
def make_llama_mlp(cls=LlamaMLP, batch=5):
    return cls(24, 52), (randn(batch, 9, 24),)


# a LLaMA decoder layer's MLP half: RMSNorm, MLP, residual
class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaMLPHalf(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.post_attention_layernorm = LlamaRMSNorm(hidden_size)
        self.mlp = LlamaMLP(hidden_size, intermediate_size)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


@case(LlamaMLPHalf, CONVERTS, style="HF LlamaDecoderLayer (MLP half)")
def make_llama_half(cls=LlamaMLPHalf, batch=5):
    return cls(24, 40), (randn(batch, 3, 24),)


# xformers-style SwiGLU with one fused w12 and chunk
class SwiGLU(nn.Module):
    def __init__(self, in_features, hidden_features, out_features=None, bias=True):
        super().__init__()
        out_features = out_features or in_features
        self.w12 = nn.Linear(in_features, 2 * hidden_features, bias=bias)
        self.w3 = nn.Linear(hidden_features, out_features, bias=bias)

    def forward(self, x):
        x12 = self.w12(x)
        x1, x2 = x12.chunk(2, dim=-1)
        hidden = F.silu(x1) * x2
        return self.w3(hidden)


@case(SwiGLU, CONVERTS, style="xformers SwiGLU")
def make_swiglu(cls=SwiGLU, batch=5):
    return cls(22, 30), (randn(batch, 5, 22),)


# GEGLU (lucidrains)
class GEGLU(nn.Module):
    def forward(self, x):
        x, gates = x.chunk(2, dim=-1)
        return x * F.gelu(gates)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4, dropout=0.):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, dim * mult * 2),
            GEGLU(),
            nn.Dropout(dropout),
            nn.Linear(dim * mult, dim)
        )

    def forward(self, x):
        return self.net(x)


@case(FeedForward, CONVERTS, style="lucidrains GEGLU FeedForward")
def make_geglu(cls=FeedForward, batch=5):
    return cls(12, mult=3), (randn(batch, 7, 12),)


# Houlsby adapter with residual
class Adapter(nn.Module):
    def __init__(self, d_model, bottleneck, init_scale=1e-3):
        super().__init__()
        self.down = nn.Linear(d_model, bottleneck)
        self.up = nn.Linear(bottleneck, d_model)
        nn.init.normal_(self.down.weight, std=init_scale)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.down.bias)
        nn.init.zeros_(self.up.bias)

    def forward(self, x):
        return x + self.up(F.relu(self.down(x)))


@case(Adapter, CONVERTS, style="Houlsby adapters")
def make_adapter(cls=Adapter, batch=5):
    m = cls(26, 8)
    with torch.no_grad():   # as after training
        for p in m.parameters():
            p.normal_(std=0.3)
    return m, (randn(batch, 4, 26),)


# LoRA as a side path: x @ A.T @ B.T * scaling
class LoRALinear(nn.Module):
    def __init__(self, in_features, out_features, r=4, lora_alpha=8, lora_dropout=0.0):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.lora_A = nn.Parameter(torch.zeros(r, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, r))
        self.scaling = lora_alpha / r
        self.lora_dropout = nn.Dropout(p=lora_dropout) if lora_dropout > 0 else nn.Identity()
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x):
        result = self.linear(x)
        result = result + (self.lora_dropout(x) @ self.lora_A.transpose(0, 1) @ self.lora_B.transpose(0, 1)) * self.scaling
        return result


@case(LoRALinear, CONVERTS, style="microsoft/LoRA loralib Linear")
def make_lora(cls=LoRALinear, batch=5):
    m = cls(20, 14)
    with torch.no_grad():
        m.lora_B.normal_(std=0.5)
    return m, (randn(batch, 20),)


# merged LoRA weight computed in forward (a derived weight)
class MergedLoRALinear(nn.Module):
    def __init__(self, in_features, out_features, r=4, alpha=16):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) / math.sqrt(in_features))
        self.bias = nn.Parameter(torch.zeros(out_features))
        self.lora_A = nn.Parameter(torch.randn(r, in_features) * 0.1)
        self.lora_B = nn.Parameter(torch.randn(out_features, r) * 0.1)
        self.scale = alpha / r

    def forward(self, x):
        w = self.weight + (self.lora_B @ self.lora_A) * self.scale
        return F.gelu(F.linear(x, w, self.bias))


@case(MergedLoRALinear, CONVERTS, style="LoRA merge at inference")
def make_merged_lora(cls=MergedLoRALinear, batch=5):
    return cls(18, 22), (randn(batch, 3, 18),)


# layer scale (CaiT / ConvNeXt) on an MLP branch
class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, drop=0.):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_features, out_features)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x):
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop1(x)
        x = self.fc2(x)
        x = self.drop2(x)
        return x


class LayerScaleMlpBlock(nn.Module):
    def __init__(self, dim, mlp_ratio=4., init_values=1e-1):
        super().__init__()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.gamma_2 = nn.Parameter(init_values * torch.ones((dim)), requires_grad=True)

    def forward(self, x):
        x = x + self.gamma_2 * self.mlp(self.norm2(x))
        return x


@case(LayerScaleMlpBlock, CONVERTS, style="timm/CaiT LayerScale block (MLP half)")
def make_layerscale(cls=LayerScaleMlpBlock, batch=5):
    return cls(16, mlp_ratio=2.5), (randn(batch, 5, 16),)


# timm DropPath on an MLP residual (identity in eval)
def drop_path(x, drop_prob: float = 0., training: bool = False, scale_by_keep: bool = True):
    if drop_prob == 0. or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0 and scale_by_keep:
        random_tensor.div_(keep_prob)
    return x * random_tensor


class DropPath(nn.Module):
    def __init__(self, drop_prob=None, scale_by_keep=True):
        super(DropPath, self).__init__()
        self.drop_prob = drop_prob
        self.scale_by_keep = scale_by_keep

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training, self.scale_by_keep)


class DropPathMlpBlock(nn.Module):
    def __init__(self, dim, hidden, drop_path_rate=0.1):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, hidden, act_layer=nn.SiLU)
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0. else nn.Identity()

    def forward(self, x):
        return x + self.drop_path(self.mlp(self.norm(x)))


@case(DropPathMlpBlock, CONVERTS, modes=EVAL, style="timm Block with DropPath (MLP half)")
def make_droppath(cls=DropPathMlpBlock, batch=5):
    return cls(14, 33), (randn(batch, 6, 14),)


# MLP-Mixer token mixing: Linear over the tokens through transposes
class MixerBlock(nn.Module):
    def __init__(self, num_tokens, dim, token_hidden, channel_hidden):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(num_tokens, token_hidden), nn.GELU(),
                                       nn.Linear(token_hidden, num_tokens))
        self.norm2 = nn.LayerNorm(dim)
        self.channel_mlp = nn.Sequential(nn.Linear(dim, channel_hidden), nn.GELU(),
                                         nn.Linear(channel_hidden, dim))

    def forward(self, x):
        y = self.norm1(x).transpose(1, 2)
        y = self.token_mlp(y).transpose(1, 2)
        x = x + y
        x = x + self.channel_mlp(self.norm2(x))
        return x


@case(MixerBlock, REFUSED, style="MLP-Mixer re-implementations")
def make_mixer(cls=MixerBlock, batch=5):
    return cls(6, 12, 10, 20), (randn(batch, 6, 12),)


# gMLP spatial gating unit (Linear over the sequence)
class SpatialGatingUnit(nn.Module):
    def __init__(self, d_ffn, seq_len):
        super().__init__()
        self.norm = nn.LayerNorm(d_ffn // 2)
        self.spatial_proj = nn.Conv1d(seq_len, seq_len, kernel_size=1)
        nn.init.constant_(self.spatial_proj.bias, 1.0)

    def forward(self, x):
        u, v = x.chunk(2, dim=-1)
        v = self.norm(v)
        v = self.spatial_proj(v)
        return u * v


class gMLPBlock(nn.Module):
    def __init__(self, d_model, d_ffn, seq_len):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.channel_proj1 = nn.Linear(d_model, d_ffn)
        self.channel_proj2 = nn.Linear(d_ffn // 2, d_model)
        self.sgu = SpatialGatingUnit(d_ffn, seq_len)

    def forward(self, x):
        residual = x
        x = self.norm(x)
        x = F.gelu(self.channel_proj1(x))
        x = self.sgu(x)
        x = self.channel_proj2(x)
        return x + residual


@case(gMLPBlock, REFUSED, style="gMLP re-implementations (Conv1d over tokens)")
def make_gmlp(cls=gMLPBlock, batch=5):
    return cls(10, 24, 5), (randn(batch, 5, 10),)


# Mamba-style gated RMSNorm between in_proj and out_proj (no SSM)
class RMSNormGated(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x, z):
        x = x * F.silu(z)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class GatedProjection(nn.Module):
    def __init__(self, d_model, d_inner):
        super().__init__()
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.norm = RMSNormGated(d_inner)
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    def forward(self, u):
        xz = self.in_proj(u)
        x, z = xz.split(xz.shape[-1] // 2, dim=-1)
        y = self.norm(x, z)
        return self.out_proj(y)


@case(GatedProjection, CONVERTS, style="Mamba2 gated RMSNorm around projections")
def make_gated_proj(cls=GatedProjection, batch=5):
    return cls(16, 28), (randn(batch, 7, 16),)


# FFN written with einsum and (in, out) weights, JAX-port style
class EinsumFFN(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(d_model, d_ff) / math.sqrt(d_model))
        self.b_in = nn.Parameter(torch.zeros(d_ff))
        self.w_out = nn.Parameter(torch.randn(d_ff, d_model) / math.sqrt(d_ff))

    def forward(self, x):
        h = torch.einsum("bsd,df->bsf", x, self.w_in) + self.b_in
        h = F.gelu(h)
        return torch.einsum("bsf,fd->bsd", h, self.w_out)


@case(EinsumFFN, CONVERTS, style="JAX/Flax port with einsum")
def make_einsum_ffn(cls=EinsumFFN, batch=5):
    return cls(14, 30), (randn(batch, 5, 14),)


# Dense layer with a (in, out) kernel and '@' (Keras/Flax port)
class Dense(nn.Module):
    def __init__(self, features_in, features, use_bias=True):
        super().__init__()
        self.kernel = nn.Parameter(torch.empty(features_in, features))
        nn.init.xavier_uniform_(self.kernel)
        self.bias = nn.Parameter(torch.zeros(features)) if use_bias else None

    def forward(self, inputs):
        y = inputs @ self.kernel
        if self.bias is not None:
            y = y + self.bias
        return y


class KerasPortMLP(nn.Module):
    def __init__(self, d_in, d_hidden, d_out):
        super().__init__()
        self.dense1 = Dense(d_in, d_hidden)
        self.dense2 = Dense(d_hidden, d_out, use_bias=False)

    def forward(self, x):
        return torch.sigmoid(self.dense2(F.elu(self.dense1(x))))


@case(KerasPortMLP, CONVERTS, style="Keras port: kernel (in, out)")
def make_keras_port(cls=KerasPortMLP, batch=5):
    return cls(12, 25, 4), (randn(batch, 12),)


# Perceiver-style pre-norm MLP with widening factor, returning the residual stream
class PerceiverMLP(nn.Module):
    def __init__(self, d, widening_factor=4):
        super().__init__()
        self.layernorm = nn.LayerNorm(d)
        self.dense1 = nn.Linear(d, d * widening_factor)
        self.dense2 = nn.Linear(d * widening_factor, d)

    def forward(self, hidden_states):
        h = self.layernorm(hidden_states)
        h = self.dense1(h)
        h = nn.functional.gelu(h)
        return hidden_states + self.dense2(h)


@case(PerceiverMLP, CONVERTS, style="HF PerceiverMLP")
def make_perceiver(cls=PerceiverMLP, batch=5):
    return cls(10), (randn(batch, 3, 10),)


# dense mixture of experts: softmax gate, stacked experts, weighted sum
class DenseMoE(nn.Module):
    def __init__(self, d_model, d_hidden, n_experts):
        super().__init__()
        self.gate = nn.Linear(d_model, n_experts)
        self.experts = nn.ModuleList([
            nn.Sequential(nn.Linear(d_model, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_model))
            for _ in range(n_experts)])

    def forward(self, x):
        gates = torch.softmax(self.gate(x), dim=-1)                      # (B, E)
        expert_out = torch.stack([e(x) for e in self.experts], dim=1)    # (B, E, D)
        return (gates.unsqueeze(-1) * expert_out).sum(dim=1)


@case(DenseMoE, CONVERTS, style="soft MoE tutorial")
def make_dense_moe(cls=DenseMoE, batch=5):
    return cls(12, 20, 3), (randn(batch, 12),)


# ALBERT-like FFN with an activation picked from a string config and a post LayerNorm
class AlbertFFN(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ffn = nn.Linear(config["hidden_size"], config["intermediate_size"])
        self.ffn_output = nn.Linear(config["intermediate_size"], config["hidden_size"])
        self.activation = {"gelu_new": lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
                           "relu": F.relu}[config["hidden_act"]]
        self.full_layer_layer_norm = nn.LayerNorm(config["hidden_size"], eps=config["layer_norm_eps"])

    def forward(self, attention_output):
        ffn_output = self.ffn(attention_output)
        ffn_output = self.activation(ffn_output)
        ffn_output = self.ffn_output(ffn_output)
        return self.full_layer_layer_norm(ffn_output + attention_output)


@case(AlbertFFN, CONVERTS, style="HF AlbertLayer FFN")
def make_albert(cls=AlbertFFN, batch=5):
    cfg = {"hidden_size": 18, "intermediate_size": 38, "hidden_act": "gelu_new", "layer_norm_eps": 1e-12}
    return cls(cfg), (randn(batch, 4, 18),)


# Input with a dim check in forward (2-D or 3-D), a common defensive pattern
class FlexibleProjector(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.proj = nn.Linear(d_in, d_out)

    def forward(self, x):
        if x.dim() == 2:
            x = x.unsqueeze(1)
        return F.layer_norm(F.relu(self.proj(x)), (self.proj.out_features,))


@case(FlexibleProjector, REFUSED, style="defensive shape checks")
def make_flexible(cls=FlexibleProjector, batch=5):
    return cls(10, 13), (randn(batch, 10),)
