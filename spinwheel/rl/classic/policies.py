"""Actor-critic MLP policies: a categorical actor for discrete actions, a diagonal Gaussian for continuous ones.

References: Spinning Up ``core.py`` (actor/critic split); Andrychowicz et al., "What Matters in On-Policy RL"
(2020) for orthogonal initialisation with a small last-layer gain on the policy.

The actor returns its distribution as one tensor ``pd`` (so it can be detached, indexed and stored as is):

============== ================= =========================================================
actor          ``pd`` shape       contents
============== ================= =========================================================
categorical    ``(B, A)``         normalised log-probabilities (``log_softmax`` of logits)
Gaussian       ``(B, 2·D)``       ``[mean, log_std]`` concatenated on the last dimension
============== ================= =========================================================

Sampling takes its noise as an argument (uniform ``(B,)`` for categorical, standard normal ``(B, D)`` for
Gaussian) so that a data-parallel rank can draw the noise of all environments from a shared generator and
keep its own slice: the actions are then exactly those of a single-process run.
No ``torch.distributions`` here: its argument checks and object creation dominate a tiny MLP's step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import gymnasium as gym
import torch
from torch import Tensor, nn
from torch.nn import functional as F

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"tanh": torch.tanh, "relu": torch.relu}

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


class MLP(nn.Module):
    """Linear layers with ``activation`` between them; orthogonal weights (gain √2, last ``out_gain``), zero bias.

    The forward loop calls ``F.linear`` directly rather than a ``Sequential`` of modules: for a 64-wide MLP the
    per-module call overhead is a visible share of a training step.
    """

    def __init__(self, sizes: list[int], activation: Callable[[Tensor], Tensor], out_gain: float):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(sizes[i], sizes[i + 1]) for i in range(len(sizes) - 1))
        self.activation = activation
        for i, linear in enumerate(self.layers):
            nn.init.orthogonal_(linear.weight, gain=out_gain if i == len(self.layers) - 1 else math.sqrt(2.0))
            nn.init.zeros_(linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        *hidden, last = self.layers
        for linear in hidden:
            x = self.activation(F.linear(x, linear.weight, linear.bias))
        return F.linear(x, last.weight, last.bias)


class CategoricalActor(nn.Module):
    """π(a|s) over ``num_actions`` discrete actions."""

    def __init__(
        self, obs_dim: int, num_actions: int, hidden_sizes: tuple[int, ...], activation: Callable[[Tensor], Tensor]
    ):
        super().__init__()
        self.net = MLP([obs_dim, *hidden_sizes, num_actions], activation, out_gain=0.01)

    def forward(self, obs: Tensor) -> Tensor:
        return torch.log_softmax(self.net(obs), dim=-1)  # (B, A)

    def noise_shape(self, batch: int) -> tuple[int, ...]:
        return (batch,)

    @staticmethod
    def sample(pd: Tensor, uniform: Tensor) -> Tensor:
        """Inverse-CDF sampling: the first action whose cumulative probability exceeds ``uniform``."""
        cdf = pd.exp().cumsum(-1)
        return (cdf < uniform.unsqueeze(-1)).sum(-1).clamp(max=pd.shape[-1] - 1)  # (B,) int64

    @staticmethod
    def mode(pd: Tensor) -> Tensor:
        return pd.argmax(-1)

    @staticmethod
    def log_prob(pd: Tensor, actions: Tensor) -> Tensor:
        return pd.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)  # (B,)

    @staticmethod
    def entropy(pd: Tensor) -> Tensor:
        return -(pd.exp() * pd).sum(-1)

    @staticmethod
    def kl(pd_old: Tensor, pd_new: Tensor) -> Tensor:
        """``KL(old ‖ new)`` per state, ``(B,)``."""
        return (pd_old.exp() * (pd_old - pd_new)).sum(-1)


class GaussianActor(nn.Module):
    """π(a|s) = N(μ(s), diag(σ²)) with a state-independent learned ``log_std``."""

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        hidden_sizes: tuple[int, ...],
        activation: Callable[[Tensor], Tensor],
        init_log_std: float = 0.0,
    ):
        super().__init__()
        self.net = MLP([obs_dim, *hidden_sizes, action_dim], activation, out_gain=0.01)
        self.log_std = nn.Parameter(torch.full((action_dim,), init_log_std))

    def forward(self, obs: Tensor) -> Tensor:
        mean = self.net(obs)
        return torch.cat([mean, self.log_std.expand_as(mean)], dim=-1)  # (B, 2D)

    def noise_shape(self, batch: int) -> tuple[int, ...]:
        return (batch, self.log_std.shape[0])

    @staticmethod
    def sample(pd: Tensor, normal: Tensor) -> Tensor:
        mean, log_std = pd.chunk(2, dim=-1)
        return mean + log_std.exp() * normal

    @staticmethod
    def mode(pd: Tensor) -> Tensor:
        return pd.chunk(2, dim=-1)[0]

    @staticmethod
    def log_prob(pd: Tensor, actions: Tensor) -> Tensor:
        mean, log_std = pd.chunk(2, dim=-1)
        z = (actions - mean) * torch.exp(-log_std)
        return (-0.5 * z.pow(2) - log_std - _HALF_LOG_2PI).sum(-1)

    @staticmethod
    def entropy(pd: Tensor) -> Tensor:
        log_std = pd.chunk(2, dim=-1)[1]
        return (log_std + 0.5 + _HALF_LOG_2PI).sum(-1)

    @staticmethod
    def kl(pd_old: Tensor, pd_new: Tensor) -> Tensor:
        mean_old, log_std_old = pd_old.chunk(2, dim=-1)
        mean_new, log_std_new = pd_new.chunk(2, dim=-1)
        var_ratio = torch.exp(2.0 * (log_std_old - log_std_new))
        mean_term = (mean_old - mean_new).pow(2) * torch.exp(-2.0 * log_std_new)
        return (log_std_new - log_std_old + 0.5 * (var_ratio + mean_term - 1.0)).sum(-1)


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs (no shared trunk), as in SB3's default ``MlpPolicy`` for PPO/TRPO."""

    def __init__(
        self,
        observation_space: gym.Space,
        action_space: gym.Space,
        hidden_sizes: tuple[int, ...] = (64, 64),
        activation: str = "tanh",
    ):
        super().__init__()
        if not isinstance(observation_space, gym.spaces.Box) or len(observation_space.shape) != 1:
            raise ValueError(f"classic policies take flat Box observations, got {observation_space}")
        act = ACTIVATIONS[activation]
        obs_dim = observation_space.shape[0]
        self.actor: CategoricalActor | GaussianActor
        if isinstance(action_space, gym.spaces.Discrete):
            self.actor = CategoricalActor(obs_dim, int(action_space.n), hidden_sizes, act)
        elif isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1:
            self.actor = GaussianActor(obs_dim, action_space.shape[0], hidden_sizes, act)
        else:
            raise ValueError(f"unsupported action space {action_space}; use Discrete or a flat Box")
        self.critic = MLP([obs_dim, *hidden_sizes, 1], act, out_gain=1.0)
        self.discrete = isinstance(self.actor, CategoricalActor)

    def value(self, obs: Tensor) -> Tensor:
        return self.critic(obs).squeeze(-1)  # (B,)

    @torch.no_grad()
    def act(self, obs: Tensor, noise: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rollout step: ``(actions, log_probs, values)`` for a batch of observations ``(B, obs_dim)``."""
        pd = self.actor(obs)
        actions = self.actor.sample(pd, noise)
        return actions, self.actor.log_prob(pd, actions), self.value(obs)

    def evaluate(self, obs: Tensor, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Training step: ``(log_probs, entropy, values)``, each ``(B,)``, with gradients."""
        pd = self.actor(obs)
        return self.actor.log_prob(pd, actions), self.actor.entropy(pd), self.value(obs)

    @torch.no_grad()
    def deterministic_action(self, obs: Tensor) -> Tensor:
        return self.actor.mode(self.actor(obs))
