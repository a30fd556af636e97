"""Rollout buffer: ``T`` steps of ``N`` environments, turned into advantages and value targets.

Reference: Spinning Up's ``PPOBuffer.finish_path``; here the bootstrapping is per step and vectorised.

Bootstrapping, in prose. The value target of a step looks one step ahead at ``V(s_{t+1})``:

- inside an episode, ``s_{t+1}`` is the next stored observation, so ``V(s_{t+1}) = values[t+1]``;
- at the last step of the rollout, the episode goes on past the data: bootstrap from ``V(s_T)``
  (``last_values``) — the rollout end is treated as a truncation;
- at a time-limit truncation the environment was reset, so ``values[t+1]`` belongs to a new episode:
  bootstrap from the value of the *final* observation (``bootstrap_values[t]``, computed at rollout time);
- at a termination the future is worth nothing: no bootstrap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from spinwheel.rl.advantages import gae, reward_to_go


@dataclass
class Batch:
    """A finished rollout, flattened time-major: sample ``t * N + i`` is step ``t`` of environment ``i``."""

    obs: Tensor  # (T*N, obs_dim)
    actions: Tensor  # (T*N,) or (T*N, act_dim)
    log_probs: Tensor  # (T*N,)
    values: Tensor  # (T*N,) V(s_t) at rollout time
    advantages: Tensor  # (T*N,) GAE-λ
    returns: Tensor  # (T*N,) λ-returns = advantages + values (value target for PPO)
    rewards_to_go: Tensor | None  # (T*N,) discounted reward-to-go, bootstrapped at cuts (VPG/TRPO value target)

    def __len__(self) -> int:
        return self.obs.shape[0]


class RolloutBuffer:
    """Preallocated storage for one rollout; write with :meth:`add`, read with :meth:`finish`."""

    def __init__(
        self,
        num_steps: int,
        num_envs: int,
        obs_shape: tuple[int, ...],
        action_shape: tuple[int, ...],
        action_dtype: torch.dtype,
    ):
        T, N = num_steps, num_envs
        self.num_steps, self.num_envs = T, N
        self.obs = torch.zeros((T, N, *obs_shape))
        self.actions = torch.zeros((T, N, *action_shape), dtype=action_dtype)
        self.log_probs = torch.zeros((T, N))
        self.values = torch.zeros((T, N))
        self.rewards = torch.zeros((T, N))
        self.terminated = torch.zeros((T, N), dtype=torch.bool)
        self.truncated = torch.zeros((T, N), dtype=torch.bool)
        self.bootstrap_values = torch.zeros((T, N))  # V(final obs) where truncated, else 0
        self._views = {
            name: getattr(self, name).numpy()
            for name in (
                "obs",
                "actions",
                "log_probs",
                "values",
                "rewards",
                "terminated",
                "truncated",
                "bootstrap_values",
            )
        }

    def add(
        self,
        t: int,
        obs: Tensor,
        actions: Tensor,
        log_probs: Tensor,
        values: Tensor,
        rewards: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        bootstrap_values: Tensor | None = None,
    ) -> None:
        """Store step ``t`` (all ``(N, ...)``); ``bootstrap_values`` only matters where ``truncated``.

        Writes go through numpy views of the tensors: a numpy row assignment costs a fraction of a torch one.
        """
        views = self._views
        views["obs"][t] = obs.numpy()
        views["actions"][t] = actions.numpy()
        views["log_probs"][t] = log_probs.numpy()
        views["values"][t] = values.numpy()
        views["rewards"][t] = rewards
        views["terminated"][t] = terminated
        views["truncated"][t] = truncated
        views["bootstrap_values"][t] = 0.0 if bootstrap_values is None else bootstrap_values.numpy()

    def finish(self, last_values: Tensor, gamma: float, lam: float, with_rewards_to_go: bool = True) -> Batch:
        """Advantages and targets given ``last_values = V(s_T)`` ``(N,)``; returns the flattened batch."""
        done = self.terminated | self.truncated
        next_values = torch.cat([self.values[1:], last_values.unsqueeze(0)])  # (T, N) V(s_{t+1}) if no reset
        next_values = torch.where(done, self.bootstrap_values, next_values)
        cut = self.truncated.clone()
        cut[-1] |= ~self.terminated[-1]  # the rollout end is a truncation
        advantages, returns = gae(self.rewards, self.values, next_values, self.terminated, cut, gamma, lam)
        rtg = reward_to_go(self.rewards, next_values, self.terminated, cut, gamma) if with_rewards_to_go else None

        def flat(x: Tensor) -> Tensor:
            return x.reshape(self.num_steps * self.num_envs, *x.shape[2:])

        return Batch(
            flat(self.obs),
            flat(self.actions),
            flat(self.log_probs),
            flat(self.values),
            flat(advantages),
            flat(returns),
            None if rtg is None else flat(rtg),
        )
