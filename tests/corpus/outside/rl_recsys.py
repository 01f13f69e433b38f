"""Reinforcement learning networks (CleanRL, SB3-style, spinning-up) and recommender
models (NCF, FM, DCN, two towers)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import CONVERTS, REFUSED, case, randn


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


# CleanRL PPO agent: critic and actor, softmax probabilities
class Agent(nn.Module):
    def __init__(self, obs_dim, n_actions):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0))
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, n_actions), std=0.01))

    def forward(self, x):
        logits = self.actor(x)
        probs = logits.softmax(dim=-1)
        return probs, self.critic(x)


@case(Agent, CONVERTS, style="CleanRL ppo.py Agent")
def make_agent(cls=Agent, batch=5):
    return cls(8, 4), (randn(batch, 8),)


# shared-trunk actor-critic returning log-probabilities and the value
class ActorCritic(nn.Module):
    def __init__(self, state_dim, action_dim, hidden=32):
        super(ActorCritic, self).__init__()
        self.fc = nn.Linear(state_dim, hidden)
        self.action_head = nn.Linear(hidden, action_dim)
        self.value_head = nn.Linear(hidden, 1)

    def forward(self, x):
        x = F.relu(self.fc(x))
        action_prob = F.log_softmax(self.action_head(x), dim=-1)
        state_values = self.value_head(x)
        return action_prob, state_values


@case(ActorCritic, CONVERTS, style="pytorch/examples actor_critic.py")
def make_ac(cls=ActorCritic, batch=5):
    return cls(4, 2), (randn(batch, 4),)


# dueling DQN
class DuelingDQN(nn.Module):
    def __init__(self, input_dim, output_dim):
        super(DuelingDQN, self).__init__()
        self.feauture_layer = nn.Sequential(nn.Linear(input_dim, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.value_stream = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))
        self.advantage_stream = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, output_dim))

    def forward(self, state):
        features = self.feauture_layer(state)
        values = self.value_stream(features)
        advantages = self.advantage_stream(features)
        qvals = values + (advantages - advantages.mean())
        return qvals


@case(DuelingDQN, REFUSED, style="cyoon1729 DuelingDQN (mean over all elements)")
def make_dueling(cls=DuelingDQN, batch=5):
    return cls(6, 3), (randn(batch, 6),)


class DuelingHead(nn.Module):
    def __init__(self, d, n_actions):
        super().__init__()
        self.value = nn.Linear(d, 1)
        self.adv = nn.Linear(d, n_actions)

    def forward(self, f):
        value = self.value(f)
        adv = self.adv(f)
        return value + adv - adv.mean(dim=1, keepdim=True)


@case(DuelingHead, CONVERTS, style="dueling head (per-row mean)")
def make_dueling_head(cls=DuelingHead, batch=5):
    return cls(21, 5), (randn(batch, 21),)


# SAC Gaussian policy: mean, clamped log_std, deterministic action with buffers
LOG_SIG_MAX = 2
LOG_SIG_MIN = -20


class GaussianPolicy(nn.Module):
    def __init__(self, num_inputs, num_actions, hidden_dim, action_low, action_high):
        super(GaussianPolicy, self).__init__()
        self.linear1 = nn.Linear(num_inputs, hidden_dim)
        self.linear2 = nn.Linear(hidden_dim, hidden_dim)
        self.mean_linear = nn.Linear(hidden_dim, num_actions)
        self.log_std_linear = nn.Linear(hidden_dim, num_actions)
        self.register_buffer("action_scale", torch.FloatTensor((action_high - action_low) / 2.))
        self.register_buffer("action_bias", torch.FloatTensor((action_high + action_low) / 2.))

    def forward(self, state):
        x = F.relu(self.linear1(state))
        x = F.relu(self.linear2(x))
        mean = self.mean_linear(x)
        log_std = self.log_std_linear(x)
        log_std = torch.clamp(log_std, min=LOG_SIG_MIN, max=LOG_SIG_MAX)
        action = torch.tanh(mean) * self.action_scale + self.action_bias
        return mean, log_std, action


@case(GaussianPolicy, CONVERTS, style="pranz24/pytorch-soft-actor-critic")
def make_sac(cls=GaussianPolicy, batch=5):
    lo, hi = np.array([-1.0, -2.0, 0.0]), np.array([1.0, 2.0, 3.0])
    return cls(11, 3, 32, lo, hi), (randn(batch, 11),)


# TD3 actor and twin critic (cat of state and action)
class TD3Actor(nn.Module):
    def __init__(self, state_dim, action_dim, max_action):
        super().__init__()
        self.l1 = nn.Linear(state_dim, 64)
        self.l2 = nn.Linear(64, 64)
        self.l3 = nn.Linear(64, action_dim)
        self.max_action = max_action

    def forward(self, state):
        a = F.relu(self.l1(state))
        a = F.relu(self.l2(a))
        return self.max_action * torch.tanh(self.l3(a))


@case(TD3Actor, CONVERTS, style="sfujim/TD3 Actor")
def make_td3_actor(cls=TD3Actor, batch=5):
    return cls(9, 2, 2.0), (randn(batch, 9),)


class TD3Critic(nn.Module):
    def __init__(self, state_dim, action_dim):
        super().__init__()
        self.l1 = nn.Linear(state_dim + action_dim, 64)
        self.l2 = nn.Linear(64, 64)
        self.l3 = nn.Linear(64, 1)
        self.l4 = nn.Linear(state_dim + action_dim, 64)
        self.l5 = nn.Linear(64, 64)
        self.l6 = nn.Linear(64, 1)

    def forward(self, state, action):
        sa = torch.cat([state, action], 1)
        q1 = F.relu(self.l1(sa))
        q1 = F.relu(self.l2(q1))
        q1 = self.l3(q1)
        q2 = F.relu(self.l4(sa))
        q2 = F.relu(self.l5(q2))
        q2 = self.l6(q2)
        return q1, q2


@case(TD3Critic, CONVERTS, style="sfujim/TD3 Critic")
def make_td3_critic(cls=TD3Critic, batch=5):
    return cls(9, 2), (randn(batch, 9), torch.rand(batch, 2) * 2 - 1)


# PPO with a Beta policy: softplus + 1
class BetaPolicy(nn.Module):
    def __init__(self, obs_dim, act_dim):
        super().__init__()
        self.base = nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.alpha_head = nn.Linear(32, act_dim)
        self.beta_head = nn.Linear(32, act_dim)

    def forward(self, x):
        x = self.base(x)
        alpha = F.softplus(self.alpha_head(x)) + 1
        beta = F.softplus(self.beta_head(x)) + 1
        return alpha, beta


@case(BetaPolicy, CONVERTS, style="PPO Beta policy (CarRacing repos)")
def make_beta(cls=BetaPolicy, batch=5):
    return cls(12, 3), (randn(batch, 12),)


# NoisyNet linear: derived weight from mu, sigma and an epsilon buffer in training
class NoisyLinear(nn.Module):
    def __init__(self, in_features, out_features, std_init=0.5):
        super(NoisyLinear, self).__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.std_init = std_init
        self.weight_mu = nn.Parameter(torch.empty(out_features, in_features))
        self.weight_sigma = nn.Parameter(torch.empty(out_features, in_features))
        self.register_buffer('weight_epsilon', torch.empty(out_features, in_features))
        self.bias_mu = nn.Parameter(torch.empty(out_features))
        self.bias_sigma = nn.Parameter(torch.empty(out_features))
        self.register_buffer('bias_epsilon', torch.empty(out_features))
        self.reset_parameters()
        self.reset_noise()

    def reset_parameters(self):
        mu_range = 1 / self.in_features ** 0.5
        self.weight_mu.data.uniform_(-mu_range, mu_range)
        self.weight_sigma.data.fill_(self.std_init / self.in_features ** 0.5)
        self.bias_mu.data.uniform_(-mu_range, mu_range)
        self.bias_sigma.data.fill_(self.std_init / self.out_features ** 0.5)

    def _scale_noise(self, size):
        x = torch.randn(size)
        return x.sign().mul_(x.abs().sqrt_())

    def reset_noise(self):
        epsilon_in = self._scale_noise(self.in_features)
        epsilon_out = self._scale_noise(self.out_features)
        self.weight_epsilon.copy_(epsilon_out.ger(epsilon_in))
        self.bias_epsilon.copy_(epsilon_out)

    def forward(self, input):
        if self.training:
            return F.linear(input, self.weight_mu + self.weight_sigma * self.weight_epsilon,
                            self.bias_mu + self.bias_sigma * self.bias_epsilon)
        else:
            return F.linear(input, self.weight_mu, self.bias_mu)


class NoisyDQN(nn.Module):
    def __init__(self, obs_dim, n_actions):
        super().__init__()
        self.fc = nn.Linear(obs_dim, 32)
        self.noisy1 = NoisyLinear(32, 32)
        self.noisy2 = NoisyLinear(32, n_actions)

    def forward(self, x):
        x = F.relu(self.fc(x))
        x = F.relu(self.noisy1(x))
        return self.noisy2(x)


@case(NoisyDQN, CONVERTS, style="Kaixhin/Rainbow NoisyLinear")
def make_noisy(cls=NoisyDQN, batch=5):
    return cls(7, 3), (randn(batch, 7),)


# NeuMF: GMF branch (elementwise of the user and item vectors) + MLP tower
class NeuMF(nn.Module):
    def __init__(self, factor_num, mlp_dims=(32, 16, 8)):
        super().__init__()
        layers = []
        d = 2 * factor_num
        for h in mlp_dims:
            layers += [nn.Dropout(p=0.0), nn.Linear(d, h), nn.ReLU()]
            d = h
        self.MLP_layers = nn.Sequential(*layers)
        self.predict_layer = nn.Linear(factor_num + d, 1)

    def forward(self, embed_user_GMF, embed_item_GMF, embed_user_MLP, embed_item_MLP):
        output_GMF = embed_user_GMF * embed_item_GMF
        interaction = torch.cat((embed_user_MLP, embed_item_MLP), -1)
        output_MLP = self.MLP_layers(interaction)
        concat = torch.cat((output_GMF, output_MLP), -1)
        prediction = self.predict_layer(concat)
        return prediction.view(-1)


@case(NeuMF, CONVERTS, style="guoyang9/NCF (after the embedding lookups)")
def make_neumf(cls=NeuMF, batch=5):
    f = 8
    return cls(f), tuple(randn(batch, f) for _ in range(4))


# factorization machine with a (n, k) factor matrix
class FactorizationMachine(nn.Module):
    def __init__(self, n, k):
        super().__init__()
        self.V = nn.Parameter(torch.randn(n, k) * 0.1)
        self.linear = nn.Linear(n, 1)

    def forward(self, x):
        square_of_sum = torch.matmul(x, self.V) ** 2
        sum_of_square = torch.matmul(x ** 2, self.V ** 2)
        interaction = 0.5 * torch.sum(square_of_sum - sum_of_square, dim=1, keepdim=True)
        return torch.sigmoid(self.linear(x) + interaction)


@case(FactorizationMachine, CONVERTS, style="FM from scratch")
def make_fm(cls=FactorizationMachine, batch=5):
    return cls(16, 5), (torch.rand(batch, 16),)


# DCN-v2 cross network (Linear per layer, x0 * (W xl + b) + xl)
class CrossNetV2(nn.Module):
    def __init__(self, input_dim, num_layers):
        super().__init__()
        self.num_layers = num_layers
        self.cross_layers = nn.ModuleList(nn.Linear(input_dim, input_dim) for _ in range(num_layers))

    def forward(self, X_0):
        X_i = X_0
        for i in range(self.num_layers):
            X_i = X_i + X_0 * self.cross_layers[i](X_i)
        return X_i


class DCNv2(nn.Module):
    def __init__(self, input_dim, num_cross, hidden):
        super().__init__()
        self.cross = CrossNetV2(input_dim, num_cross)
        self.deep = nn.Sequential(nn.Linear(input_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.fc = nn.Linear(input_dim + hidden, 1)

    def forward(self, x):
        out = torch.cat([self.cross(x), self.deep(x)], dim=-1)
        return torch.sigmoid(self.fc(out))


@case(DCNv2, CONVERTS, style="FuxiCTR / DCN-v2 CrossNetV2")
def make_dcnv2(cls=DCNv2, batch=5):
    return cls(13, 2, 24), (randn(batch, 13, scale=0.5),)


# DCN (v1) cross layer in DeepCTR's vector form with tensordot
class CrossNetV1(nn.Module):
    def __init__(self, in_features, layer_num=2):
        super(CrossNetV1, self).__init__()
        self.layer_num = layer_num
        self.kernels = nn.Parameter(torch.Tensor(self.layer_num, in_features, 1))
        self.bias = nn.Parameter(torch.Tensor(self.layer_num, in_features, 1))
        for i in range(self.kernels.shape[0]):
            nn.init.xavier_normal_(self.kernels[i])
        for i in range(self.bias.shape[0]):
            nn.init.zeros_(self.bias[i])

    def forward(self, inputs):
        x_0 = inputs.unsqueeze(2)
        x_l = x_0
        for i in range(self.layer_num):
            xl_w = torch.tensordot(x_l, self.kernels[i], dims=([1], [0]))
            dot_ = torch.matmul(x_0, xl_w)
            x_l = dot_ + self.bias[i] + x_l
        x_l = torch.squeeze(x_l, dim=2)
        return x_l


@case(CrossNetV1, REFUSED, style="shenweichen/DeepCTR-Torch CrossNet")
def make_dcnv1(cls=CrossNetV1, batch=5):
    return cls(10), (randn(batch, 10),)


# two-tower retrieval score
class TwoTower(nn.Module):
    def __init__(self, user_dim, item_dim, emb_dim, temperature=0.05):
        super().__init__()
        self.user_tower = nn.Sequential(nn.Linear(user_dim, 32), nn.ReLU(), nn.Linear(32, emb_dim))
        self.item_tower = nn.Sequential(nn.Linear(item_dim, 32), nn.ReLU(), nn.Linear(32, emb_dim))
        self.temperature = temperature

    def forward(self, user_feats, item_feats):
        u = F.normalize(self.user_tower(user_feats), dim=-1)
        v = F.normalize(self.item_tower(item_feats), dim=-1)
        return (u * v).sum(-1) / self.temperature


@case(TwoTower, CONVERTS, style="two-tower retrieval (paired scores)")
def make_two_tower(cls=TwoTower, batch=5):
    return cls(10, 14, 8), (randn(batch, 10), randn(batch, 14))


# curiosity (ICM) forward model: features and a one-hot action concatenated
class ICMForward(nn.Module):
    def __init__(self, feat_dim, n_actions):
        super().__init__()
        self.forward_net = nn.Sequential(nn.Linear(feat_dim + n_actions, 64), nn.LeakyReLU(),
                                         nn.Linear(64, feat_dim))

    def forward(self, phi, action_onehot):
        pred = self.forward_net(torch.cat([phi, action_onehot], 1))
        intrinsic = 0.5 * (pred - phi).pow(2).sum(dim=1)
        return pred, intrinsic


@case(ICMForward, CONVERTS, style="curiosity-driven exploration (ICM)")
def make_icm(cls=ICMForward, batch=5):
    a = torch.randint(0, 4, (batch,))
    return cls(12, 4), (randn(batch, 12), F.one_hot(a, 4).float())


# RND target/predictor with ELU and an intrinsic reward
class RND(nn.Module):
    def __init__(self, obs_dim, out_dim=16):
        super().__init__()
        self.predictor = nn.Sequential(nn.Linear(obs_dim, 32), nn.ELU(), nn.Linear(32, 32), nn.ELU(),
                                       nn.Linear(32, out_dim))
        self.target = nn.Sequential(nn.Linear(obs_dim, 32), nn.ELU(), nn.Linear(32, out_dim))
        for p in self.target.parameters():
            p.requires_grad = False

    def forward(self, next_obs):
        target_feature = self.target(next_obs)
        predict_feature = self.predictor(next_obs)
        reward = (target_feature - predict_feature).pow(2).sum(1) / 2
        return reward


@case(RND, CONVERTS, style="random network distillation repos")
def make_rnd(cls=RND, batch=5):
    return cls(10), (randn(batch, 10),)


# discrete SAC soft Q with a value computed under the policy probabilities
class DiscreteSoftQ(nn.Module):
    def __init__(self, obs_dim, n_actions, alpha=0.2):
        super().__init__()
        self.q = nn.Sequential(nn.Linear(obs_dim, 48), nn.ReLU(), nn.Linear(48, n_actions))
        self.pi = nn.Sequential(nn.Linear(obs_dim, 48), nn.ReLU(), nn.Linear(48, n_actions))
        self.alpha = alpha

    def forward(self, obs):
        q = self.q(obs)
        logits = self.pi(obs)
        probs = F.softmax(logits, dim=1)
        log_probs = F.log_softmax(logits, dim=1)
        v = (probs * (q - self.alpha * log_probs)).sum(dim=1, keepdim=True)
        return v


@case(DiscreteSoftQ, CONVERTS, style="discrete SAC value target")
def make_dsac(cls=DiscreteSoftQ, batch=5):
    return cls(9, 4), (randn(batch, 9),)
